"""Anthropic's Messages API served by the engine: the calls (`_wire.py`), the whole `message`
response and the streamed event sequence.

A stream is: `message_start`, then per content block `content_block_start`,
`content_block_delta` (`text_delta`, `thinking_delta` for text the model's
family marks as reasoning, or `input_json_delta` for a tool's input) and
`content_block_stop`, then `message_delta` (stop_reason and usage) and
`message_stop`; a failure after the start is an `error` event. Each SSE event
carries its type twice, as `event:` and in its data, as Anthropic's do.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from ..._errors import ContextLengthExceededError, InvalidRequestError
from ...engine import Engine, Finished, RequestStream, TextDelta, ToolCallDelta, ToolCalls, Usage
from .._http import HTTPError, dumps
from .._pump import ChoiceResult
from .._records import COUNT_TOKENS_PATH as COUNT_TOKENS_PATH
from .._records import MESSAGES_PATH as MESSAGES_PATH
from .._wire import api_error
from ._protocol import CountTokensRequest, MessagesRequest, error_body, error_payload

# This API's name for each `GenerationOptions` field `MessagesRequest.to_options` sets, and for
# the messages: how an engine error names its parameter here (`_wire.api_error`).
PARAMS = {
    "max_tokens": "max_tokens", "fit_max_tokens": "max_tokens", "stop": "stop_sequences",
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "ignore_eos": "ignore_eos",
    "tools": "tools", "tool_choice": "tool_choice", "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "response_format": "output_config.format", "continue_final_message": "messages", "messages": "messages",
}
INNER = {".parameters": ".input_schema"}  # a tool's schema, in a place inside `tools`


def stop_reason(fin: Finished, stop_sequences: Sequence[str], clamped: bool = False) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer; `clamped`: it could run to the context's end only."""
    if fin.finish_reason == "length":
        return ("model_context_window_exceeded" if clamped else "max_tokens"), None
    if fin.finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(fin.stop, str) and fin.stop in stop_sequences:
        return "stop_sequence", fin.stop
    return "end_turn", None


def too_long(exc: ContextLengthExceededError) -> InvalidRequestError:
    """A prompt that does not fit, in Anthropic's wording (`prompt is too long: N tokens > M
    maximum`): the one Claude Code recognizes as an overflow, and compacts its conversation on."""
    if exc.prompt_tokens is None or exc.context_length is None:
        return api_error(exc, PARAMS, INNER)
    return InvalidRequestError(f"prompt is too long: {exc.prompt_tokens} tokens > {exc.context_length} maximum",
                               param="messages", code=exc.code)


def usage_dict(usage: Usage) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` are those prefilled, `cache_read_input_tokens` those the
    prompt cache gave (their sum is the prompt); the cache is written without being asked, so
    nothing is counted as written."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesCall:
    def __init__(self, req: MessagesRequest):
        self.req = req
        self.model: str | None = req.model
        self.stream = req.stream
        # Translated here, so that a bad request gets its 400 before the engine sees it.
        self.messages = req.chat_messages()
        self.options = req.to_options()
        self.clamped = False  # max_tokens did not fit beside the prompt: the context's end is the limit

    async def start(self, engine: Engine) -> RequestStream:
        try:
            stream = await engine.chat(self.messages, self.options).__aenter__()
        except ContextLengthExceededError as exc:
            raise too_long(exc) from None
        except InvalidRequestError as exc:
            raise api_error(exc, PARAMS, INNER) from None
        self.clamped = stream.clamped
        return stream

    def encoder(self, rid: str, model: str, prompt_tokens: int, cached: Callable[[], int] | None = None) -> MessageEncoder:
        return MessageEncoder(rid, model, prompt_tokens, self.req.stop_sequences or (), self.clamped, cached)

    def whole(self, rid: str, model: str, result: ChoiceResult) -> bytes:
        fin = result.finished
        assert fin is not None
        content: list[dict[str, Any]] = []
        if result.reasoning:
            content.append({"type": "thinking", "thinking": "".join(result.reasoning), "signature": ""})
        parts = result.in_order()  # as the stream's blocks come
        if not parts:
            content.append({"type": "text", "text": ""})  # an answer has its text block, empty or not
        for part in parts:
            if isinstance(part, str):
                content.append({"type": "text", "text": part})
            else:
                content.append({"type": "tool_use", "id": part.id, "name": part.name,
                                "input": _tool_input(part.arguments)})
        reason, sequence = stop_reason(fin, self.req.stop_sequences or (), self.clamped)
        return dumps({
            "id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage_dict(fin.usage),
        })


class CountTokensCall:
    def __init__(self, req: CountTokensRequest):
        self.model: str | None = req.model
        self.messages = req.chat_messages()
        self.tools = req.tool_options()
        self.prefill = req.prefill()

    async def respond(self, engine: Engine) -> bytes:
        try:
            n = await engine.count_chat_tokens(self.messages, tools=self.tools.get("tools"),
                                               tool_choice=self.tools.get("tool_choice"),
                                               continue_final_message=self.prefill)
        except ContextLengthExceededError as exc:
            raise too_long(exc) from None
        except InvalidRequestError as exc:
            raise api_error(exc, PARAMS, INNER) from None
        return dumps({"input_tokens": n})


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind, **data}) + b"\n\n"


class MessageEncoder:
    """The SSE events of one streamed message (`_wire.StreamEncoder`)."""

    __slots__ = ("rid", "model", "prompt_tokens", "stop_sequences", "clamped", "cached", "started", "index",
                 "open_kind", "had_text", "called", "streamed", "_head")

    def __init__(self, rid: str, model: str, prompt_tokens: int, stop_sequences: Sequence[str],
                 clamped: bool = False, cached: Callable[[], int] | None = None):
        self.rid, self.model, self.prompt_tokens = rid, model, prompt_tokens
        self.stop_sequences, self.clamped = stop_sequences, clamped
        self.cached = cached  # the prompt's tokens the prompt cache gave: known by the first event
        self.started = False  # whether message_start went out
        self.index = 0  # the index of the next content block
        self.open_kind: str | None = None  # "text", "thinking" or "tool_use": the block being written
        self.had_text = self.called = False
        self.streamed: set[int] = set()  # calls that came as deltas: their ToolCalls entry only closes them
        self._head = b""

    def start(self) -> bytes:
        """Nothing yet: message_start goes out with the first event (`_begin`), once the prompt
        cache has said how much of the prompt it gave, so that its usage is the one
        message_delta ends with (the pump sends `: ping` comments until then)."""
        return b""

    def _begin(self) -> bytes:
        self.started = True
        cached = self.cached() if self.cached is not None else 0
        return _event("message_start", {"message": {
            "id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens - cached, "output_tokens": 0,
                      "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}}})

    def _open(self, kind: str) -> bytes:
        if self.open_kind == kind:
            return b""
        closing = self._close() if self.open_kind is not None else b""
        self.open_kind = kind
        self.had_text = self.had_text or kind == "text"
        field = kind if kind == "thinking" else "text"
        # The hot path's bytes: one concatenation around the json-escaped text (rule 7).
        self._head = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
                      b'"delta":{"type":"%s_delta","%s":' % (self.index, kind.encode(), field.encode()))
        block: dict[str, Any] = ({"type": "text", "text": ""} if kind == "text" else
                                 {"type": "thinking", "thinking": "", "signature": ""})
        return closing + _event("content_block_start", {"index": self.index, "content_block": block})

    def _close(self) -> bytes:
        self.open_kind = None
        self.index += 1
        return _event("content_block_stop", {"index": self.index - 1})

    def event(self, ev: Any) -> bytes:
        if not self.started:
            return self._begin() + self.event(ev)
        if type(ev) is TextDelta:
            out = b""
            if ev.reasoning:
                out = self._open("thinking") + self._head + dumps(ev.reasoning) + b"}}\n\n"
            if ev.text:
                out += self._open("text") + self._head + dumps(ev.text) + b"}}\n\n"
            return out
        if type(ev) is ToolCallDelta:
            return self._call_delta(ev)
        if type(ev) is not ToolCalls:
            return b""
        parts = []
        for call in ev.calls:
            if call.index in self.streamed:  # its block is the open one; its input has all come
                if self.open_kind == "tool_use":
                    parts.append(self._close())
                continue
            if self.open_kind is not None:
                parts.append(self._close())
            self.called = True
            parts.append(_event("content_block_start", {"index": self.index, "content_block": {
                "type": "tool_use", "id": call.id, "name": call.name, "input": {}}}))
            parts.append(_event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": call.arguments}}))
            parts.append(self._close())
        return b"".join(parts)

    def _call_delta(self, d: ToolCallDelta) -> bytes:
        """A streamed call: its tool_use block opens with id, name and an empty input, then
        each arguments fragment is an input_json_delta. A call that then fails to parse
        has its block closed by what follows (its text, or the end)."""
        out = b""
        if d.index not in self.streamed:
            self.streamed.add(d.index)
            self.called = True
            out = self._close() if self.open_kind is not None else b""
            self.open_kind = "tool_use"
            out += _event("content_block_start", {"index": self.index, "content_block": {
                "type": "tool_use", "id": d.id, "name": d.name, "input": {}}})
        if d.arguments and self.open_kind == "tool_use":
            out += _event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": d.arguments}})
        return out

    def finish(self, fin: Finished) -> bytes:
        parts = [] if self.started else [self._begin()]
        if not self.had_text and not self.called:
            parts.append(self._open("text"))  # an answer without a call has its text block, empty or not
        if self.open_kind is not None:
            parts.append(self._close())
        reason, sequence = stop_reason(fin, self.stop_sequences, self.clamped)
        parts.append(_event("message_delta", {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage_dict(fin.usage)}))
        parts.append(_event("message_stop", {}))
        return b"".join(parts)

    def error(self, err: HTTPError) -> bytes:
        return _event("error", {"error": error_payload(err)["error"]})


class MessagesAPI:
    """`POST /v1/messages` (`_wire.WireAPI`)."""

    id_prefix = "msg_"
    accept_x_api_key = True

    def parse(self, obj: dict[str, Any]) -> MessagesCall:
        return MessagesCall(MessagesRequest.model_validate(obj))

    def error_body(self, err: HTTPError) -> bytes:
        return error_body(err)


class CountTokensAPI(MessagesAPI):
    """`POST /v1/messages/count_tokens`."""

    def parse(self, obj: dict[str, Any]) -> CountTokensCall:  # type: ignore[override]
        return CountTokensCall(CountTokensRequest.model_validate(obj))
