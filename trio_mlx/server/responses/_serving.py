"""OpenAI's Responses API served by the engine: the call (`_wire.py`), the `response` object and
its streamed events.

Output items: a `reasoning` item (its `reasoning_text`) when the model's
family marks text as reasoning, one `message` (its `output_text`) when the
model wrote text or made no call, then one `function_call` item per call. A stream is
`response.created`, `response.in_progress`; for the message
`response.output_item.added`, `response.content_part.added`,
`response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`, `response.output_item.done` (a reasoning item
the same, with `response.reasoning_text.delta` and `.done`); for each call
`response.output_item.added`, `response.function_call_arguments.delta`,
`response.function_call_arguments.done`, `response.output_item.done` (a call
streams its arguments in fragments as the model writes them, for families
whose calls stream: docs/engine.md; one that then fails to parse ends as an
item with status "incomplete", and its text follows as a message); then
`response.completed` (or `response.incomplete` at max_output_tokens) with the
whole response and its usage. A failure after the start is an `error` event
and `response.failed`. Every event has a `sequence_number`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ..._errors import InvalidRequestError
from ...engine import (
    Engine,
    Finished,
    RequestStream,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolCalls,
    Usage,
)
from .._http import HTTPError, dumps, new_id
from .._pump import ChoiceResult
from .._records import RESPONSES_PATH as RESPONSES_PATH
from .._wire import api_error
from ._protocol import ResponsesRequest

log = logging.getLogger("trio_mlx.http")

# This API's name for each `GenerationOptions` field `ResponsesRequest.to_options` sets, and for
# the messages: how an engine error names its parameter here (`_wire.api_error`).
PARAMS = {
    "max_tokens": "max_output_tokens", "temperature": "temperature", "top_p": "top_p",
    "ignore_eos": "ignore_eos", "tools": "tools", "tool_choice": "tool_choice",
    "parallel_tool_calls": "parallel_tool_calls", "response_format": "text.format", "messages": "input",
    "cache_salt": "cache_salt",
}


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}




class ResponsesCall:
    def __init__(self, req: ResponsesRequest):
        req.check()
        self.req = req
        self.model: str | None = req.model
        self.stream = bool(req.stream)
        # Translated here, so that a bad request gets its 400 before the engine sees it.
        self.messages = req.chat_messages()
        self.names = req.tool_names()
        if self.names.skipped:
            log.warning("a responses request named tools this server cannot run (hosted tools); left "
                        "out: %s", ", ".join(self.names.skipped))
        self.options = req.to_options(self.names.chat_tools)
        self.created = int(time.time())

    async def start(self, engine: Engine) -> RequestStream:
        stream = engine.chat(self.messages, self.options)
        try:
            return await stream.__aenter__()
        except InvalidRequestError as exc:
            raise api_error(exc, PARAMS) from None

    def response(self, rid: str, model: str, status: str, output: list[dict[str, Any]],
                 usage: Usage | None = None, error: HTTPError | None = None) -> dict[str, Any]:
        """The `response` object (what the endpoint returns, and streamed events carry)."""
        req = self.req
        fmt = req.text.format if req.text and req.text.format else None
        return {
            "id": rid, "object": "response", "created_at": self.created, "status": status,
            "error": None if error is None else {"code": error.code or error.type, "message": error.message},
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": None, "store": False,
            # null where the request left them to the model's defaults (its generation_config)
            "temperature": req.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "top_p": req.top_p, "truncation": "disabled",
            "usage": None if usage is None else usage_dict(usage), "metadata": req.metadata or {},
            "user": None,
        }

    def call_item(self, call: ToolCall, status: str = "completed", arguments: str | None = None) -> dict[str, Any]:
        """The output item of `call` (`ToolNames.item`: a function call, namespaced or not, or a
        custom tool's call)."""
        return self.names.item(call.id.removeprefix("call_"), call.id, call.name,
                               call.arguments if arguments is None else arguments, status)

    def encoder(self, rid: str, model: str, prompt_tokens: int, cached: Callable[[], int] | None = None) -> ResponseEncoder:
        return ResponseEncoder(self, rid, model)

    def whole(self, rid: str, model: str, result: ChoiceResult) -> bytes:
        fin = result.finished
        assert fin is not None
        status = "incomplete" if fin.finish_reason == "length" else "completed"
        output = []
        if result.reasoning:
            output.append(reasoning_item(new_id("rs_"), "".join(result.reasoning), status))
        parts = result.in_order()  # as the stream's items come
        if not parts:
            output.append(message_item(new_id("msg_"), "", status))
        for part in parts:
            output.append(message_item(new_id("msg_"), part, status) if isinstance(part, str)
                          else self.call_item(part))
        return dumps(self.response(rid, model, status, output, fin.usage))


class ResponseEncoder:
    """The SSE events of one streamed response (`_wire.StreamEncoder`)."""

    __slots__ = ("call", "rid", "model", "seq", "output", "open_kind", "open_id", "text", "had_message", "open_call",
                 "_head", "_tail")

    def __init__(self, call: ResponsesCall, rid: str, model: str):
        self.call, self.rid, self.model = call, rid, model
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open_kind: str | None = None  # "message", "reasoning" or "function_call": the item being written
        self.open_call: ToolCall | None = None  # the streamed call being written (its arguments in `text`)
        self.open_id = ""
        self.text: list[str] = []  # the open item's text
        self.had_message = False
        self._head = self._tail = b""

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        self.seq += 1
        return (b"event: " + kind.encode() + b"\ndata: "
                + dumps({"type": kind, **data, "sequence_number": self.seq - 1}) + b"\n\n")

    def start(self) -> bytes:
        r = self.call.response(self.rid, self.model, "in_progress", [])
        return self._event("response.created", {"response": r}) + self._event("response.in_progress", {"response": r})

    def _open(self, kind: str) -> bytes:
        """Close the open item (if another kind) and open a message or a reasoning item."""
        if self.open_kind == kind:
            return b""
        closing = self._close() if self.open_kind is not None else b""
        self.open_kind, self.text = kind, []
        self.open_id = item_id = new_id("msg_" if kind == "message" else "rs_")
        index = len(self.output)
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        # The hot path's bytes: one concatenation around the json-escaped text (rule 7).
        self._head = (b'event: ' + delta.encode() + b'\ndata: {"type":"' + delta.encode() + b'","item_id":"'
                      + item_id.encode() + b'","output_index":%d,"content_index":0,"delta":' % index)
        self._tail = b',"logprobs":[],"sequence_number":%d}\n\n' if kind == "message" else b',"sequence_number":%d}\n\n'
        if kind == "message":
            self.had_message = True
            item: dict[str, Any] = {"id": item_id, "type": "message", "status": "in_progress", "role": "assistant",
                                    "content": []}
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": item_id, "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        return (closing + self._event("response.output_item.added", {"output_index": index, "item": item})
                + self._event("response.content_part.added", {
                    "item_id": item_id, "output_index": index, "content_index": 0, "part": part}))

    def _close(self, status: str = "completed") -> bytes:
        kind, item_id, index, text = self.open_kind, self.open_id, len(self.output), "".join(self.text)
        self.open_kind = None
        if kind == "function_call":
            return self._close_call("incomplete")  # ended by something else than its whole call: it failed
        if kind == "message":
            item = message_item(item_id, text, status)
            done = self._event("response.output_text.done", {
                "item_id": item_id, "output_index": index, "content_index": 0, "text": text, "logprobs": []})
        else:
            item = reasoning_item(item_id, text, status)
            done = self._event("response.reasoning_text.done", {
                "item_id": item_id, "output_index": index, "content_index": 0, "text": text})
        self.output.append(item)
        return (done + self._event("response.content_part.done", {
                    "item_id": item_id, "output_index": index, "content_index": 0, "part": item["content"][0]})
                + self._event("response.output_item.done", {"output_index": index, "item": item}))

    def _delta(self, text: str) -> bytes:
        self.text.append(text)
        self.seq += 1
        return self._head + dumps(text) + self._tail % (self.seq - 1)

    def event(self, ev: Any) -> bytes:
        if type(ev) is TextDelta:
            out = b""
            if ev.reasoning:
                out = self._open("reasoning") + self._delta(ev.reasoning)
            if ev.text:
                out += self._open("message") + self._delta(ev.text)
            return out
        if type(ev) is ToolCallDelta:
            return self._call_delta(ev)
        if type(ev) is not ToolCalls:
            return b""
        parts = []
        for c in ev.calls:
            if self.open_call is not None and self.open_call.index == c.index:
                parts.append(self._close_call("completed", c))
                continue
            if self.open_kind is not None:
                parts.append(self._close())
            index = len(self.output)
            item = self.call.call_item(c)
            added = self._event("response.output_item.added", {
                "output_index": index, "item": self.call.call_item(c, "in_progress", "")})
            if item["type"] == "function_call":
                where = {"item_id": item["id"], "output_index": index}
                added += (self._event("response.function_call_arguments.delta", {**where, "delta": c.arguments})
                          + self._event("response.function_call_arguments.done", {
                              **where, "arguments": c.arguments, "name": item["name"]}))
            parts += [added, self._event("response.output_item.done", {"output_index": index, "item": item})]
            self.output.append(item)
        return b"".join(parts)

    def _call_delta(self, d: ToolCallDelta) -> bytes:
        """A streamed call: its item is added with the id and name, then each arguments
        fragment is a function_call_arguments.delta; its whole `ToolCall` closes it."""
        out = b""
        if self.open_call is None or self.open_call.index != d.index:
            out = self._close() if self.open_kind is not None else b""
            self.open_kind, self.text = "function_call", []
            self.open_call = ToolCall(d.index, d.id, d.name, "")
            out += self._event("response.output_item.added", {
                "output_index": len(self.output), "item": self.call.call_item(self.open_call, "in_progress", "")})
        if d.arguments:
            self.text.append(d.arguments)
            if not self.call.names.is_custom(d.name):  # a custom call's input comes whole, at its end
                item_id = "fc_" + d.id.removeprefix("call_")
                out += self._event("response.function_call_arguments.delta", {
                    "item_id": item_id, "output_index": len(self.output), "delta": d.arguments})
        return out

    def _close_call(self, status: str, whole: ToolCall | None = None) -> bytes:
        call, index = self.open_call, len(self.output)
        assert call is not None
        arguments = whole.arguments if whole is not None else "".join(self.text)
        self.open_kind, self.open_call, self.text = None, None, []
        item = self.call.call_item(call, status, arguments)
        self.output.append(item)
        args = b""
        if item["type"] == "function_call":  # a custom call's input comes in its item alone
            args = self._event("response.function_call_arguments.done", {
                "item_id": item["id"], "output_index": index, "arguments": arguments, "name": item["name"]})
        return args + self._event("response.output_item.done", {"output_index": index, "item": item})

    def finish(self, fin: Finished) -> bytes:
        status = "incomplete" if fin.finish_reason == "length" else "completed"
        parts = []
        if not self.had_message and not any(o["type"] in ("function_call", "custom_tool_call")
                                            for o in self.output):
            parts.append(self._open("message"))  # an answer without a call has its message, empty or not
        if self.open_kind is not None:
            parts.append(self._close(status))
        r = self.call.response(self.rid, self.model, status, self.output, fin.usage)
        parts.append(self._event(f"response.{status}", {"response": r}))
        return b"".join(parts)

    def error(self, err: HTTPError) -> bytes:
        # the item being written ends, incomplete, and the failed response holds what was sent
        closing = self._close("incomplete") if self.open_kind is not None else b""
        r = self.call.response(self.rid, self.model, "failed", self.output, error=err)
        return (closing + self._event("error", {"code": err.code, "message": err.message, "param": err.param})
                + self._event("response.failed", {"response": r}))


class ResponsesAPI:
    """`POST /v1/responses` (`_wire.WireAPI`): errors in OpenAI's shape."""

    id_prefix = "resp_"
    accept_x_api_key = False

    def parse(self, obj: dict[str, Any]) -> ResponsesCall:
        return ResponsesCall(ResponsesRequest.model_validate(obj))

    def error_body(self, err: HTTPError) -> bytes:
        return err.body()
