"""A request's tools and response format: checked, compiled off the event loop, then applied.

`engine.chat(..., tools=, tool_choice=, response_format=)` and
`engine.generate(..., response_format=)` end up here when their stream is
entered: `check_structure` checks the options (OpenAI's shapes, a 400 naming
the problem), `compile_structure` turns them into the one `Grammar` the actor
enforces (a response format; the call format `tool_choice` "required" or a
named function demands; or, for tools beside a response format, either calls
or an answer in the format), and `Structure.tool_stream` makes the
`_tools.ToolCallStream` that splits the generated text into content,
reasoning and calls. Compiling runs in a worker thread (llguidance builds a grammar with the
GIL released; a large schema takes milliseconds to tens of them), behind a
limiter of its own, and compiled grammars are kept for reuse: agents send the
same tools and schema with every turn.
"""

from __future__ import annotations

import collections
import json
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from .._errors import InvalidRequestError
from ..actor import Grammar
from ._grammar_pool import grammar_pool
from ._limiters import RunLimiter, half_the_cores
from ._options import GenerationOptions

if TYPE_CHECKING:
    from ._grammar import Draft

# Compiled grammars kept for reuse, by what they were compiled from. Arbitrary:
# enough for the tool sets and schemas of a few agents at once.
_CACHE_SIZE = 128
_compile_limiter = RunLimiter("trio_mlx_grammar_limiter", half_the_cores)




@dataclass(frozen=True)
class Structure:
    """A request's checked tools and response format."""

    tools: tuple[dict[str, Any], ...] = ()  # as `check_tools` returns them
    tool_choice: str = "none"  # "auto", "none", "required" or a function's name
    response_format: Mapping[str, Any] | None = None
    parallel_tool_calls: bool = True

    @property
    def uses_tools(self) -> bool:
        """Whether the model is told about the tools and its calls are read: a
        tool_choice of "none" leaves them out of the prompt, so no call can come."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_kwargs(self) -> dict[str, Any]:
        return {"tools": list(self.tools)} if self.uses_tools else {}

    def tool_stream(self, tokenizer: Any, prompt: list[int], grammar: Grammar | None) -> Any:
        """A fresh `ToolCallStream` for one response, or None without tools. It starts
        in "reasoning" where the prompt leaves a thinking block open (as
        mlx_lm.server decides), unless a grammar holds the reply from its first token."""
        if not self.uses_tools:
            return None
        from ._tools import ToolCallStream

        initial = "normal"
        if grammar is None and getattr(tokenizer, "has_thinking", False):
            if tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
                initial = "reasoning"
            initial = getattr(tokenizer, "response_initial_state", None) or initial
        return ToolCallStream(tokenizer, self.tools, initial=initial)


NO_STRUCTURE = Structure()


def check_structure(tokenizer: Any, options: GenerationOptions, *, chat: bool) -> Structure:
    """Check the options `tools`, `tool_choice`, `parallel_tool_calls` (chat only) and
    `response_format`; cheap, on the event loop."""
    from ._tools import check_tool_choice, check_tools, require_tool_support

    tools_in, choice_in = options.tools, options.tool_choice
    response_format = options.response_format
    if response_format is not None and not isinstance(response_format, Mapping):
        raise InvalidRequestError("response_format must be an object", param="response_format")
    if response_format is not None and response_format.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequestError(
            "response_format.type must be 'text', 'json_object' or 'json_schema', not "
            f"{response_format.get('type')!r}", param="response_format")
    if not chat and (tools_in is not None or choice_in is not None):
        raise InvalidRequestError("tools need a chat request (engine.chat)", param="tools")
    if not chat and (options.continue_final_message or options.chat_template_kwargs is not None):
        field = "continue_final_message" if options.continue_final_message else "chat_template_kwargs"
        raise InvalidRequestError(f"{field} needs a chat request (engine.chat)", param=field)
    parallel = options.parallel_tool_calls
    if not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls must be true or false", param="parallel_tool_calls")
    if tools_in is None and choice_in is None and response_format is None:
        return NO_STRUCTURE
    tools = check_tools(tools_in) if tools_in is not None else []
    choice = check_tool_choice(choice_in, tools)
    if tools and choice != "none":
        require_tool_support(tokenizer)
    if response_format is not None and response_format.get("type", "text") != "text" and choice not in ("auto", "none"):
        raise InvalidRequestError(
            f"tool_choice {choice!r} and a response_format cannot both be enforced: a reply is "
            "either a call or an answer in the format; use tool_choice 'auto'",
            param="response_format",
        )
    return Structure(tuple(tools), choice, response_format, parallel)


async def compile_structure(tokenizer: Any, model_path: Any, s: Structure) -> Grammar | None:
    """The grammar the actor enforces for `s`, or None (free generation). In a worker
    thread; a 400 for a schema or tool list that cannot be enforced."""
    formatted = s.response_format is not None and s.response_format.get("type", "text") != "text"
    # Tools beside a response format: a call, or an answer in the format (one grammar).
    enforced = s.tool_choice not in ("auto", "none") or (formatted and s.uses_tools)
    if not enforced and not formatted:
        return None
    key = (str(model_path), *_key(s, enforced))
    if (hit := _cache.get(key)) is not None:
        return hit
    draft, source = await trio.to_thread.run_sync(_draft, tokenizer, model_path, s, enforced,
                                                  limiter=_compile_limiter())
    if draft is None:
        return None
    # The check may take long and much memory: in a worker process, bounded (`_grammar_pool.py`).
    grammar = await grammar_pool(str(model_path), source).check(draft)
    _cache.put(key, grammar)
    return grammar


def _key(s: Structure, enforced: bool) -> tuple[Any, ...]:
    """What the grammar depends on, as one hashable value (a schema's key order matters
    to llguidance only in the order of required keys; json.dumps keeps it)."""
    fmt = json.dumps(s.response_format, sort_keys=False, default=str)
    if enforced:
        return ("tools", s.tool_choice, s.parallel_tool_calls, json.dumps(s.tools, default=str), fmt)
    return ("format", fmt)


def _draft(tokenizer: Any, model_path: Any, s: Structure, enforced: bool) -> tuple[Draft | None, Any]:
    """The grammar's text (unchecked) and what the grammar workers build the tokenizer from."""
    from ..actor._matcher import grammar_vocab, is_panic
    from ._grammar import answer_schema, draft_response_format, vocab_for
    from ._tools import tool_draft

    try:  # kept under the model's path too, where an actor in this process finds it
        grammar_vocab(tokenizer, key=str(model_path))
    except ValueError:
        pass
    vocab_for(tokenizer, param="tools" if enforced else "response_format")  # the 400 that names it
    try:
        if enforced:
            answer = answer_schema(s.response_format) if s.tool_choice == "auto" else None
            draft = tool_draft(tokenizer, list(s.tools), s.tool_choice, parallel=s.parallel_tool_calls,
                               answer=answer)
        else:
            draft = draft_response_format(s.response_format)
    except BaseException as exc:
        if not is_panic(exc):
            raise
        param = "tools" if enforced else "response_format"
        raise InvalidRequestError(f"{param}: the grammar engine failed on it ({str(exc)[:200]})",
                                  param=param) from None
    return draft, _tokenizer_source(tokenizer)


_sources: weakref.WeakKeyDictionary[Any, tuple[str, list[int]]] = weakref.WeakKeyDictionary()


def _tokenizer_source(tokenizer: Any) -> tuple[str, list[int]]:
    """`_matcher.tokenizer_source` once per tokenizer (a large vocabulary's JSON takes ~0.1 s)."""
    source = _sources.get(tokenizer)
    if source is None:
        from ..actor._matcher import tokenizer_source

        source = _sources[tokenizer] = tokenizer_source(tokenizer)
    return source


class _Cache:
    """A small LRU of compiled grammars (thread-safe: compiles finish in worker threads,
    but `put` runs on the event loop; the lock only guards a second engine's loop)."""

    def __init__(self, size: int):
        self._size = size
        self._items: collections.OrderedDict[tuple[Any, ...], Grammar | None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, ...]) -> Grammar | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: tuple[Any, ...], value: Grammar | None) -> None:
        if value is None:
            return
        with self._lock:
            self._items[key] = value
            while len(self._items) > self._size:
                self._items.popitem(last=False)


_cache = _Cache(_CACHE_SIZE)
