"""OpenAI's Responses API on the wire: the request model and its translation into the engine's
OpenAI-shaped chat messages, tools and response format.

Field names follow the official `openai` SDK's types (`openai.types.responses`:
`ResponseCreateParams`, `EasyInputMessageParam`, `ResponseFunctionToolCallParam`,
`FunctionCallOutput`, `FunctionToolParam`, `ResponseTextConfigParam`). The
server keeps no responses: a request carries its whole conversation in
`input` (`store` false or absent), and `previous_response_id` or a
`conversation` get a 400 saying so.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...engine import GenerationOptions
from ...engine._text import media_refusal
from .._http import HTTPError, dumps


class _Strict(BaseModel):
    # Unknown fields are ignored (clients send many: metadata, include, reasoning, ...); types are strict.
    model_config = ConfigDict(extra="ignore", strict=True)


class ContentPart(_Strict):
    type: str
    text: str | None = None
    refusal: str | None = None


class InputItem(_Strict):
    """A message (`role` and `content`), a `function_call` the model made, or a
    `function_call_output` the client sends back; which fields matter depends on `type`."""

    type: str | None = Field(None, description="message (the default when role is given), "
                                               "function_call, function_call_output")
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None
    arguments: str | None = None
    input: str | None = None  # a custom tool's call
    output: str | list[ContentPart] | None = None


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class FunctionTool(_Strict):
    """A `function` tool, a `namespace` of function tools (`tools`), a `custom` (freeform) tool, or
    a hosted tool (web_search and the like), which this server leaves out."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[FunctionTool] | None = None
    format: dict[str, Any] | None = None


class ResponsesRequest(_Strict):
    """`POST /v1/responses`."""

    model: str | None = Field(None, description="the served model id; absent: the served model")
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = Field(False, description="null: false (as OpenAI's API takes it; sglang-router sends it)")
    store: bool | None = Field(None, description="must be false or absent: this server keeps no responses")
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    ignore_eos: bool = Field(False, description="an extension (as on the chat endpoint): "
                                                "generate max_output_tokens tokens")
    cache_salt: str | None = Field(None, description="an extension (as on the chat endpoint): the prompt "
                                   "cache is shared only among requests of the same salt")

    def check(self) -> None:
        if self.previous_response_id is not None:
            raise _bad("previous_response_id", "this server keeps no responses: send the whole "
                       "conversation in input (with store false) instead of previous_response_id")
        if self.conversation is not None:
            raise _bad("conversation", "this server keeps no conversations: send the whole "
                       "conversation in input")
        if self.store:
            raise _bad("store", "this server keeps no responses: send store false (or leave it out)")
        if self.background:
            raise _bad("background", "background responses are not supported by this server")

    def to_options(self, tools: list[dict[str, Any]] | None = None) -> GenerationOptions:
        """The engine's options for this request: every field is read here, once (`tools`
        as `structure` takes them)."""
        return GenerationOptions(
            max_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p,
            ignore_eos=self.ignore_eos, cache_salt=self.cache_salt, **self.structure(tools),
        )

    def structure(self, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """`engine.chat`'s tools (`tools`, as `ToolNames.chat_tools` made them; made here when
        not given), tool_choice, parallel_tool_calls and response_format."""
        if tools is None:
            tools = self.tool_names().chat_tools
        out: dict[str, Any] = {}
        if tools:
            out["tools"] = tools
            if self.tool_choice is not None:
                out["tool_choice"] = chat_tool_choice(self.tool_choice)
            if self.parallel_tool_calls is False:
                out["parallel_tool_calls"] = False
        elif self.tool_choice not in (None, "none", "auto"):
            raise _bad("tool_choice", f"tool_choice {self.tool_choice!r} needs tools")
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type != "text":
            out["response_format"] = response_format(fmt)
        return out

    def chat_messages(self) -> list[dict[str, Any]]:
        return chat_messages(self.instructions, self.input)

    def tool_names(self) -> ToolNames:
        return ToolNames(self.tools)


def _bad(param: str, message: str, code: str = "invalid_value") -> HTTPError:
    return HTTPError(400, f"{param}: {message}", param=param, code=code)


def _content(content: str | list[ContentPart] | None, param: str) -> str | list[dict[str, Any]]:
    """A message's or an output's content: its text, or OpenAI chat's parts where it holds an
    image or a file (the engine refuses those in the user's last turn and notes them elsewhere:
    the models served read text only)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if part.type in ("input_text", "output_text", "text") and part.text is not None:
            parts.append({"type": "text", "text": part.text})
        elif part.type == "refusal" and part.refusal is not None:
            parts.append({"type": "text", "text": part.refusal})
        elif part.type in ("input_image", "input_file"):
            parts.append({"type": part.type})
        else:
            raise _bad(f"{param}.{j}", f"content parts may be text, images and files, got type {part.type!r}")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def flat_name(namespace: str | None, name: str) -> str:
    """The one name a namespaced function tool has for the model: `namespace__name`, joined as
    Codex joins them where a boundary cannot keep the two apart."""
    return f"{namespace.rstrip('_')}__{name.lstrip('_')}" if namespace else name


# Items that carry nothing the model reads again: its own reasoning (its text is not sent back
# here), hosted tools' calls (none are served), and a compacted history's opaque summary.
_DROPPED_ITEMS = frozenset({"reasoning", "web_search_call", "file_search_call", "computer_call",
                            "code_interpreter_call", "image_generation_call", "compaction",
                            "compaction_summary", "ghost_snapshot"})


def chat_messages(instructions: str | None, items: str | list[InputItem]) -> list[dict[str, Any]]:
    """`instructions` and `input` -> OpenAI-shaped chat messages.

    `function_call` and `custom_tool_call` items join the assistant message before
    them as its `tool_calls` (a response's output is a message, then its calls; a
    namespaced call under its flat name, a custom call's input as the argument
    `input`); `function_call_output` and `custom_tool_call_output` items become
    `role: "tool"` messages; the model's reasoning and hosted tools' items are dropped.
    """
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        out.append({"role": "user", "content": items})
        return out
    for i, item in enumerate(items):
        kind = item.type or ("message" if item.role else None)
        param = f"input.{i}"
        if kind == "message":
            if item.role is None:
                raise _bad(f"{param}.role", "a message needs a role")
            role = "system" if item.role == "developer" else item.role
            content = _content(item.content, f"{param}.content")
            if role == "user" and i == len(items) - 1 and not isinstance(content, str):
                j, part = next((j, p) for j, p in enumerate(content) if p["type"] != "text")
                what = "image" if part["type"] == "input_image" else "file"
                raise _bad(f"{param}.content.{j}", media_refusal(what), "unsupported_content")
            out.append({"role": role, "content": content})
        elif kind in ("function_call", "custom_tool_call"):
            custom = kind == "custom_tool_call"
            if not item.call_id or not item.name or (item.input if custom else item.arguments) is None:
                raise _bad(param, f"a {kind} item needs call_id, name and {'input' if custom else 'arguments'}")
            arguments = dumps({"input": item.input}).decode() if custom else item.arguments
            if not custom:  # the engine checks it too, where the item's place is lost
                try:
                    json.loads(arguments or "")
                except ValueError as exc:
                    raise _bad(f"{param}.arguments", f"not JSON: {exc}") from None
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": flat_name(item.namespace, item.name), "arguments": arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if not item.call_id:
                raise _bad(param, f"a {kind} item needs call_id")
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _content(item.output, f"{param}.output")})
        elif kind in _DROPPED_ITEMS:
            continue
        elif kind == "item_reference":
            raise _bad(param, "this server keeps no items: send the item itself, not a reference")
        else:
            raise _bad(f"{param}.type", "input items may be messages, function and custom tool calls and "
                                        f"their outputs, got {kind!r}")
    if not out:
        raise _bad("input", "the input holds no message")
    return out


class ToolNames:
    """The request's tools as the engine's function tools, and the way back from the name the
    model called to the item the client expects.

    A `namespace` (Codex groups tools so) is flattened into its function tools, each
    named `namespace__name` (`flat_name`); their calls go back with `name` and
    `namespace` apart. A `custom` tool (free text in, as Codex's apply_patch) becomes a
    function of one string argument, `input`, and its calls go back as
    `custom_tool_call` items. Hosted tools (web_search and the like) cannot run here:
    they are left out, named in `skipped`, rather than refused, so that agents that
    send them by default work.
    """

    def __init__(self, tools: list[FunctionTool] | None):
        self.chat_tools: list[dict[str, Any]] = []
        self.skipped: list[str] = []
        self._origin: dict[str, tuple[str, str, str | None]] = {}  # flat name -> (kind, name, namespace)
        for i, t in enumerate(tools or ()):
            if t.type == "namespace":
                if not t.name:
                    raise _bad(f"tools.{i}.name", "a namespace tool needs a name")
                for j, inner in enumerate(t.tools or ()):
                    if inner.type != "function":
                        self.skipped.append(f"{t.name}.{inner.name or inner.type}")
                        continue
                    self._add(inner, f"tools.{i}.tools.{j}", "function", t.name)
            elif t.type in ("function", "custom"):
                self._add(t, f"tools.{i}", t.type, None)
            else:
                self.skipped.append(t.type)

    def _add(self, t: FunctionTool, param: str, kind: str, namespace: str | None) -> None:
        if not t.name:
            raise _bad(f"{param}.name", f"a {kind} tool needs a name")
        name = flat_name(namespace, t.name)
        if kind == "custom":
            note = "Its input is free text, given whole as the string argument `input`."
            grammar = (t.format or {}).get("definition")
            if isinstance(grammar, str) and grammar:
                note += f" The input follows this {(t.format or {}).get('syntax', '')} grammar:\n{grammar}"
            description = f"{t.description}\n\n{note}" if t.description else note
            function: dict[str, Any] = {"name": name, "description": description, "parameters": {
                "type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}
        else:
            function = {"name": name, "parameters": t.parameters or {"type": "object"}}
            if t.description is not None:
                function["description"] = t.description
            if t.strict is not None:
                function["strict"] = t.strict
        self.chat_tools.append({"type": "function", "function": function})
        self._origin[name] = (kind, t.name, namespace)

    def item(self, item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        """The output item of a call the model made to the tool it knows as `name`."""
        kind, original, namespace = self._origin.get(name, ("function", name, None))
        if kind == "custom":
            try:
                value = json.loads(arguments) if arguments else {}
            except ValueError:
                value = {}
            text = value.get("input") if isinstance(value, dict) else None
            return {"id": "ctc_" + item_id, "type": "custom_tool_call", "status": status, "call_id": call_id,
                    "name": original, "input": text if isinstance(text, str) else arguments}
        out = {"id": "fc_" + item_id, "type": "function_call", "status": status, "call_id": call_id,
               "name": original, "arguments": arguments}
        if namespace is not None:
            out["namespace"] = namespace
        return out

    def is_custom(self, name: str) -> bool:
        return self._origin.get(name, ("function",))[0] == "custom"


def chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    """"auto" / "none" / "required" as they are; {"type": "function", "name"} nested as chat's."""
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _bad("tool_choice", f"tool_choice must be 'auto', 'none', 'required' or a function, got {choice!r}")
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice", 'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}')


def response_format(fmt: TextFormat) -> dict[str, Any]:
    """`text.format` -> chat's `response_format`."""
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise _bad("text.format.schema", "a json_schema format needs its schema")
    spec: dict[str, Any] = {"name": fmt.name or "output", "schema": fmt.schema_}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    if fmt.description is not None:
        spec["description"] = fmt.description
    return {"type": "json_schema", "json_schema": spec}
