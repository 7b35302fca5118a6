"""Tool calling: check `tools` / `tool_choice`, enforce a required call, split calls from text.

The model's own chat template renders the tools (its `tools` argument) and
mlx-lm knows each family's call markup: its tokenizer wrapper says whether the
template supports tools (`has_tool_calling`), which text opens and closes a
call (`tool_call_start` / `tool_call_end`) and which of `mlx_lm.tool_parsers`
reads one (`tool_parser`). This module builds on that:

- `check_tools`, `check_tool_choice`: OpenAI's shapes, with a 400 naming the
  problem (`require_tool_support`: a model whose template has no tools).
- `tool_grammar`: for `tool_choice` "required" or a named function, a Lark
  grammar (`_grammar.compile_lark`) that admits only the family's markup
  around a JSON object matching one of the allowed tools, enforced token by
  token like a response format. Families with a grammar: `_CALL_FORMATS`.
- `ToolCallStream`: splits the generated text, delta by delta, into content,
  reasoning and tool calls, with mlx-lm's own text state machine (the one
  mlx_lm.server uses) and the family's parser, so call markup never reaches
  the content. Calls of JSON families also stream while written
  (`ToolCallDelta`s), read by an incremental scan (`_JsonCallScanner`).
- `template_messages`: OpenAI history (assistant `tool_calls` whose arguments
  are JSON text) in the shape chat templates expect (arguments as objects).

No MLX here: the state machine lives in mlx_lm.generate, which imports
mlx.core; `models/_text_machine.py` reaches it, as the engine reaches its
tokenizer through `models`.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .._errors import InvalidRequestError
from ._events import ToolCall, ToolCallDelta
from ._grammar import JSON_OPTIONS, Draft, Grammar, check_draft, draft_lark, vocab_for

log = logging.getLogger("trio_mlx.tools")

ToolChoice = Literal["auto", "none", "required"] | str  # a str other than those: a function's name
# Tool names: the longest any API served allows, Anthropic's 128 (OpenAI's functions have 64:
# one more in between costs nothing, and MCP-style names `mcp__server__tool` run long)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")


# -- checking a request -----------------------------------------------------------------


def require_tool_support(tokenizer: Any) -> None:
    """A 400 for `tools` sent to a model whose chat template has no tool calling."""
    if not getattr(tokenizer, "has_tool_calling", False):
        raise InvalidRequestError(
            "this model does not support tool calling: its chat template does not render "
            "tools in a tool-call format mlx-lm recognizes",
            param="tools",
        )


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI `tools` -> the same list, checked: each a function with a valid, unique
    name and an object `parameters` schema (default: no parameters)."""
    if not isinstance(tools, Sequence) or isinstance(tools, str) or not tools:
        raise InvalidRequestError("tools must be a non-empty list", param="tools")
    seen: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise InvalidRequestError(f"{where}.type must be 'function'", param=where)
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise InvalidRequestError(f"{where}.function must be an object", param=where)
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequestError(
                f"{where}.function.name must be 1-128 letters, digits, '_' or '-'", param=where
            )
        if name in seen:
            raise InvalidRequestError(f"{where}: two tools are named {name!r}", param=where)
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping) or params.get("type", "object") != "object":
            raise InvalidRequestError(
                f"{where}.function.parameters must be a JSON schema of type 'object'", param=where
            )
        out.append({"type": "function", "function": {**fn, "parameters": dict(params)}})
    return out


def check_tool_choice(tool_choice: Any, tools: Sequence[Mapping[str, Any]] | None) -> ToolChoice:
    """OpenAI `tool_choice` -> "auto", "none", "required" or the named function's name."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("auto", "none", "required"):
        if tool_choice == "required" and not tools:
            raise InvalidRequestError("tool_choice is 'required' but no tools were given", param="tool_choice")
        return tool_choice  # type: ignore[no-any-return]
    name = None
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise InvalidRequestError(
            "tool_choice must be 'auto', 'none', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if not any(t["function"]["name"] == name for t in tools or ()):
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return name


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Assistant `tool_calls` with arguments as objects, as chat templates render them
    (OpenAI sends them as JSON text; mlx_lm.server converts them the same way)."""
    out = []
    for i, msg in enumerate(messages):
        calls = msg.get("tool_calls")
        if not calls:
            out.append(dict(msg))
            continue
        fixed = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise InvalidRequestError(
                    f"messages[{i}].tool_calls[{j}] must have a function with a name",
                    param=f"messages[{i}].tool_calls",
                )
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as exc:
                    raise InvalidRequestError(
                        f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {exc}",
                        param=f"messages[{i}].tool_calls",
                    ) from exc
            fixed.append({**call, "function": {**fn, "arguments": args}})
        out.append({**msg, "tool_calls": fixed})
    return out


# -- enforcing a call --------------------------------------------------------------------


def _json_tools_calls(start: str, end: str, schema: str, parallel: bool) -> str:
    """mlx_lm.tool_parsers.json_tools (Hermes, Qwen2.5, Qwen3): `<tool_call>\\n{json}\\n</tool_call>`."""
    more = ' ("\\n" call)*' if parallel else ""
    return f'calls: call{more}\ncall: {start} "\\n" %json {schema} "\\n" {end}\n'


# Tool-call formats a grammar can enforce, by mlx-lm parser module. Each takes
# the Lark forms of the family's opening and closing markup (`_markup`), the
# JSON schema of one call's object and whether several calls may follow, and
# defines the rule `calls`.
_CALL_FORMATS: dict[str, Callable[[str, str, str, bool], str]] = {
    "mlx_lm.tool_parsers.json_tools": _json_tools_calls,
}


def _markup(vocab: Any, text: str) -> str:
    """`text` as a Lark term. llguidance counts every added token as special (Qwen's
    `<tool_call>` and the test model's too) and never lets plain text spell one, so
    markup that is one such token must be named by its id."""
    ids = vocab.tokenizer.tokenize_str(text)
    if len(ids) == 1 and vocab.tokenizer.is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(text, ensure_ascii=False)


def tool_grammar(
    tokenizer: Any, tools: Sequence[Mapping[str, Any]], tool_choice: ToolChoice, *, parallel: bool = True,
    answer: Mapping[str, Any] | None = None,
) -> Grammar | None:
    """`tool_draft`'s grammar, checked in this thread (the server checks it in its
    grammar checkers, `_grammar_pool.py`, under a bound on time and memory)."""
    draft = tool_draft(tokenizer, tools, tool_choice, parallel=parallel, answer=answer)
    return None if draft is None else check_draft(vocab_for(tokenizer, param=draft.param), draft)


def tool_draft(
    tokenizer: Any, tools: Sequence[Mapping[str, Any]], tool_choice: ToolChoice, *, parallel: bool = True,
    answer: Mapping[str, Any] | None = None,
) -> Draft | None:
    """The grammar text (unchecked) that enforces `tool_choice` ("required" or a function's name);
    None for "auto" and "none", which leave the model free. `tools` as `check_tools`
    returns them. With `answer` (a JSON schema, with tool_choice "auto"): the
    model either calls tools or answers in that schema, nothing else (OpenAI's
    tools beside a JSON response_format). A 400 when the model's call format has
    no grammar here."""
    if tool_choice == "none" or (tool_choice == "auto" and answer is None):
        return None
    require_tool_support(tokenizer)
    family = getattr(tokenizer.tool_parser, "__module__", "?")
    fmt = _CALL_FORMATS.get(family)
    if fmt is None:
        raise InvalidRequestError(
            f"tool_choice {tool_choice!r} cannot be enforced for this model's tool-call "
            f"format ({family.rpartition('.')[2]}); use tool_choice 'auto'",
            param="tool_choice",
        )
    chosen = [t["function"] for t in tools if tool_choice in ("required", "auto") or t["function"]["name"] == tool_choice]
    calls: list[dict[str, Any]] = [
        {
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for fn in chosen
    ]
    schema: dict[str, Any] = {"anyOf": calls} if len(calls) > 1 else calls[0]
    # OpenAI's functions are not strict unless they say so: keywords the grammar
    # engine does not implement are then ignored rather than refused.
    schema["x-guidance"] = {**JSON_OPTIONS, "lenient": not all(fn.get("strict") is True for fn in chosen)}
    vocab = vocab_for(tokenizer, param="tools")
    lark = fmt(
        _markup(vocab, tokenizer.tool_call_start), _markup(vocab, tokenizer.tool_call_end),
        json.dumps(schema, ensure_ascii=False), parallel,
    )
    if answer is None:
        return draft_lark("start: calls\n" + lark, kind="tools", param="tools")
    lark = f"start: calls | answer\nanswer: %json {json.dumps(answer, ensure_ascii=False)}\n" + lark
    return draft_lark(lark, kind="tools", param="response_format")


# -- reading calls out of the text --------------------------------------------------------

# Families whose call is one JSON object {"name": ..., "arguments": {...}} between
# the markup, which `_JsonCallScanner` reads as it arrives (as vLLM's hermes
# parser streams them). The others' calls come whole, once closed: their
# markup (XML-ish parameters, pythonic calls, several calls in one block) has
# no prefix that says safely which text is the arguments' JSON.
_STREAMED_FAMILIES = frozenset({"mlx_lm.tool_parsers.json_tools"})


class _JsonCallScanner:
    """One call's text, `{"name": "f", "arguments": {...}}`, scanned once, a chunk at a time.

    It tracks only the JSON structure (depth, strings, escapes) and the keys of
    the outer object, so each character is looked at once however the tokens
    split the text, and no text is kept but the arguments' and the outer keys'
    (design.md rule 7). vLLM's hermes parser instead re-parses the whole call
    with partial_json_parser on every token and diffs re-serialized arguments.
    It learns the name once its string is closed (never half a name), and where
    the arguments' value starts and ends: a nested object's closing brace, or a
    brace inside a string, is not the end. Only an object value streams: a
    string or other value's text is not the arguments' text, so it comes whole
    at the close. Anything unexpected (a list of calls, text before the object)
    stops the scan: the call then comes whole, if its parser reads it.
    """

    __slots__ = ("depth", "in_str", "esc", "literal", "want_key", "key", "name", "args", "args_object",
                 "parts", "broken")

    def __init__(self) -> None:
        self.depth = 0
        self.in_str = self.esc = False
        self.literal: list[str] | None = None  # an outer key's (or the name's) string, being read
        self.want_key = True  # in the outer object: the next string is a key (else a value)
        self.key: str | None = None
        self.name: str | None = None
        self.args = 0  # the arguments' value: 0 not begun, 1 being written, 2 ended
        self.args_object = False
        self.parts: list[str] = []  # the arguments' text, as fed (an object value only)
        self.broken = False

    def feed(self, chunk: str) -> str:
        """Scan the next piece of the call's text; return the arguments' text in it."""
        if self.broken:
            return ""
        start = 0 if self.args == 1 else -1  # where the arguments' text in this chunk begins
        end = len(chunk)
        lit = 0  # where this chunk's part of `literal` begins
        for i, c in enumerate(chunk):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
                    if self.literal is not None:
                        self.literal.append(chunk[lit : i + 1])
                        self._string("".join(self.literal))
                        self.literal = None
                continue
            if c == '"':
                self.in_str = True
                if self.depth == 1 and (self.want_key or self.key == "name"):
                    self.literal, lit = [], i
                elif self._value_starts(False):
                    start = i
            elif c == "{" or c == "[":
                if self.depth == 0 and c == "[":
                    self.broken = True  # several calls in a list: they come whole
                    return ""
                if self._value_starts(c == "{"):
                    start = i
                self.depth += 1
            elif c == "}" or c == "]":
                self.depth -= 1
                if self.args == 1 and self.depth <= 1:
                    self.args, end = 2, i + 1
            elif self.depth == 1 and c == ":":
                self.want_key = False
            elif self.depth == 1 and c == ",":
                if self.args == 1:
                    self.args = 2  # a bare value (a number, true, ...) ended: it does not stream
                self.want_key, self.key = True, None
            elif not c.isspace():
                if self.depth == 0:
                    self.broken = True  # not one JSON object
                    return ""
                if self._value_starts(False):
                    start = i
        if self.literal is not None:
            self.literal.append(chunk[lit:])
        if start < 0 or not self.args_object:
            return ""
        fragment = chunk[start:end]
        self.parts.append(fragment)
        return fragment

    def _value_starts(self, is_object: bool) -> bool:
        if self.depth == 1 and not self.want_key and self.key == "arguments" and self.args == 0:
            self.args, self.args_object = 1, is_object
            return True
        return False

    def _string(self, literal: str) -> None:
        try:
            value = json.loads(literal)
        except ValueError:
            self.broken = True
            return
        if self.want_key:
            self.key = value
        elif self.key == "name" and self.name is None:
            self.name = value

    def arguments_text(self) -> str | None:
        """The arguments' whole text as the model wrote it, once an object value has ended."""
        if self.broken or not self.args_object or self.args != 2:
            return None
        return "".join(self.parts)


@dataclass(frozen=True, slots=True)
class Refused:
    """The text of a call the family's parser could not read (or read otherwise than it
    streamed): never content, though the engine sends it as content."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolDelta:
    """What one piece of generated text adds to the response: its reasoning, then its
    content (str), calls' `ToolCallDelta`s, whole calls (`ToolCall`) and refused
    calls, in the order the text has them (a piece may close a call and go on)."""

    reasoning: str = ""
    items: tuple[str | ToolCallDelta | ToolCall | Refused, ...] = ()

    @property
    def content(self) -> str:
        return "".join(i for i in self.items if type(i) is str)

    @property
    def calls(self) -> tuple[ToolCallDelta | ToolCall, ...]:
        return tuple(i for i in self.items if type(i) is ToolCallDelta or type(i) is ToolCall)

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        return tuple(i for i in self.items if type(i) is ToolCall)

    @property
    def failed(self) -> tuple[str, ...]:
        return tuple(i.text for i in self.items if type(i) is Refused)


def _object_arguments(args: Any) -> str | None:
    """A parsed call's arguments as JSON text, where they are an object (or a string holding
    one's JSON, as some models write them); None otherwise. Every API gives a call's input as
    an object (Anthropic's `input`; OpenAI's `arguments`, which clients parse and index), so a
    call with other arguments (`[1, 2]`, a bare string) is no call: its text is content, in
    streamed and whole answers alike."""
    if isinstance(args, str):
        try:
            return args if isinstance(json.loads(args), dict) else None
        except ValueError:
            return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


class ToolCallStream:
    """Splits generated text into content, reasoning and tool calls, one delta at a time.

    Feed it the text deltas in order (after stop strings were cut), then call
    `finish()` once. Whitespace between calls, or before one, is dropped, not
    sent as content.

    Each call is reported whole (a `ToolCall`) once its closing markup (or the
    end of the text) arrives and the family's parser has read it. For the
    families in `_STREAMED_FAMILIES` it also streams while it is written, as
    `ToolCallDelta`s: the index, id and name once the name is complete, then
    the arguments' JSON text in fragments; the `ToolCall`'s `arguments` is then
    that text exactly (the fragments joined), the parser's reading of it
    checked to be the same value. A streamed call the parser cannot read, or
    reads otherwise than it streamed (another name), is `failed`: no more
    fragments, no `ToolCall`, its text comes as content; its index stays used.
    """

    def __init__(self, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None, *, initial: str = "normal"):
        from ..models._text_machine import text_state_machine  # imported where used, as models is

        require_tool_support(tokenizer)
        machine = text_state_machine(tokenizer)
        self._split, self._flush = machine.split, machine.flush
        self._state = machine.make_state(initial)
        self._parse = tokenizer.tool_parser
        self._streams = getattr(self._parse, "__module__", None) in _STREAMED_FAMILIES
        self._tools = list(tools) if tools else None
        self._where = initial
        self._scan: _JsonCallScanner | None = None  # the open call, in a streamed family
        self._head: ToolCallDelta | None = None  # its first delta, once sent
        self._sent: list[str] = []  # its arguments' text sent so far
        self._call_text: list[str] = []
        self._held = ""  # content's trailing whitespace, dropped if a call follows
        self._count = 0
        self._completed = 0

    @property
    def called(self) -> bool:
        """Whether any call was reported whole: the response's finish_reason is then "tool_calls"."""
        return self._completed > 0

    def feed(self, text: str) -> ToolDelta:
        self._state, segments = self._split(self._state, text)
        return self._take(segments)

    def finish(self) -> ToolDelta:
        """The text held back (a possible start of markup) and a call left open at the end."""
        self._state, rest, where = self._flush(self._state)
        delta = self._take([(where, rest)], end=True)
        if not self._count and self._held:
            delta = ToolDelta(delta.reasoning, (self._held, *delta.items))
        self._held = ""
        return delta

    def _take(self, segments: list[tuple[str | None, str]], *, end: bool = False) -> ToolDelta:
        reasoning: list[str] = []
        items: list[str | ToolCallDelta | ToolCall | Refused] = []
        for where, text in segments:
            if self._where == "tool" and where != "tool":
                self._close(items)
            self._where = where or "normal"
            if where == "tool":
                self._call_text.append(text)
                self._held = ""
                if self._streams:
                    self._stream(text, items)
            elif where == "reasoning":
                reasoning.append(text)
            else:  # trailing whitespace waits: before a call it is dropped
                body = text.rstrip()
                if body:
                    items.append(self._held + body)
                    self._held = ""
                self._held += text[len(body):]
        if end and self._where == "tool":
            self._close(items)
        return ToolDelta("".join(reasoning), tuple(items))

    def _stream(self, text: str, out: list[str | ToolCallDelta | ToolCall | Refused]) -> None:
        scan = self._scan
        if scan is None:
            scan = self._scan = _JsonCallScanner()
        fragment = scan.feed(text)
        head = self._head
        if head is None:
            if scan.broken or scan.name is None or not _NAME.fullmatch(scan.name):
                return  # no name yet (or not one a call could have): nothing to say
            head = self._head = ToolCallDelta(self._count, f"call_{uuid.uuid4().hex[:24]}", scan.name, "")
            self._count += 1
            out.append(head)
            fragment = "".join(scan.parts)  # arguments written before the name
        if fragment:
            out.append(ToolCallDelta(head.index, head.id, head.name, fragment))
            self._sent.append(fragment)

    def _close(self, calls: list[str | ToolCallDelta | ToolCall | Refused]) -> None:
        text, self._call_text = "".join(self._call_text), []
        scan, head, sent = self._scan, self._head, "".join(self._sent)
        self._scan, self._head, self._sent = None, None, []
        if not text.strip():
            return
        try:
            parsed = self._parse(text, self._tools)
        except Exception as exc:  # the parsers raise what their format's reader raises
            log.warning("a tool call did not parse (%s: %s)", type(exc).__name__, exc)
            calls.append(Refused(text))
            return
        found = parsed if isinstance(parsed, list) else [parsed]
        if head is not None:
            assert scan is not None
            call = self._streamed_call(found, scan, head, sent)
            if call is None:
                log.warning("a streamed tool call was read otherwise than it streamed: %r", text[:200])
                calls.append(Refused(text))
                return
            if len(call.arguments) > len(sent):
                calls.append(ToolCallDelta(head.index, head.id, head.name, call.arguments[len(sent):]))
            calls.append(call)
            self._completed += 1
            return
        arguments = [_object_arguments(one.get("arguments", {})) if isinstance(one, Mapping) else None
                     for one in found]
        if None in arguments:
            log.warning("a tool call's arguments are not a JSON object: %r", text[:200])
            calls.append(Refused(text))
            return
        for one, args in zip(found, arguments, strict=True):
            calls.append(
                ToolCall(
                    index=self._count,
                    id=str(one.get("id") or f"call_{uuid.uuid4().hex[:24]}"),
                    name=str(one.get("name")),
                    arguments=args or "{}",
                )
            )
            self._count += 1
            self._completed += 1

    @staticmethod
    def _streamed_call(found: list[Any], scan: _JsonCallScanner, head: ToolCallDelta, sent: str) -> ToolCall | None:
        """The whole call that `head` and the arguments' text `sent` began, if the
        parser read that call: its arguments are the text the model wrote when that is
        the same value (so the fragments join into them), else the parser's value as JSON."""
        if len(found) != 1 or not isinstance(found[0], Mapping) or found[0].get("name") != head.name:
            return None
        args = found[0].get("arguments", {})
        if _object_arguments(args) is None:
            return None
        raw = scan.arguments_text()  # an object's text only: a string's text is not its value
        arguments = None
        if raw is not None:
            try:
                if json.loads(raw) == args:
                    arguments = raw
            except ValueError:
                pass
        if arguments is None:
            arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        if not arguments.startswith(sent):
            return None
        return ToolCall(head.index, head.id, head.name, arguments)
