"""OpenAI's responses: whole answers, streamed chunks, and the endpoints' handler.

`Completions` is the raw-ASGI handler of POST /v1/chat/completions and
/v1/completions: it admits a request (its `n` choices tokenized and compiled once)
and hands it to the shared machinery of `_pump.py`, with `chat_response` /
`completion_response` for a whole answer and a `ChunkEncoder` for a stream.
Streamed chunks are cut from byte templates made once per request around one
json-escaped string, never built through pydantic or nested dicts: that code runs
once per SSE event on the event loop, which shares the GIL with the GPU actor
(docs/design.md, rule 7).
"""

from __future__ import annotations

import codecs
import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any

import trio

from ...engine import (
    Engine,
    Finished,
    RequestStream,
    TextDelta,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    ToolCalls,
    Usage,
)
from .._adapters import answered_as, pick_adapter
from .._asgi import (
    REQUEST_ID,
    Disconnected,
    Receive,
    Scope,
    Send,
    request_id,
    scope_cors,
    send_error,
    send_response,
    unless_disconnected,
)
from .._http import HTTPError, dumps, new_id, now
from .._pump import ChoiceResult, Pump, close_all, log, read_json_request, refuse
from .._records import CHAT_PATH, RequestRecord, ServerHost
from ._protocol import ChatCompletionRequest, CompletionRequest

DONE = b"data: [DONE]\n\n"
# OpenAI reports the log-probability of impossible tokens as -9999.0; JSON has no -Infinity.
_LOGPROB_FLOOR = -9999.0
_SEED_MASK = 2**64 - 1

def usage_dict(usage: Usage) -> dict[str, Any]:
    return total_usage([usage])


def total_usage(usages: Sequence[Usage]) -> dict[str, Any]:
    """n choices share one prompt: it is counted once, completions are summed. Its
    `cached_tokens` (OpenAI's `prompt_tokens_details`) are the fewest any choice took from
    the prompt cache: the first choice's prompt is the one the others reuse. Where
    speculative decoding drafted tokens for them, `completion_tokens_details` says how many
    were kept and how many were not, as OpenAI reports its predicted outputs."""
    prompt = usages[0].prompt_tokens if usages else 0
    completion = sum(u.completion_tokens for u in usages)
    cached = min((u.cached_tokens for u in usages), default=0)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}
    drafted = sum(u.draft_tokens for u in usages)
    if drafted:
        accepted = sum(u.accepted_draft_tokens for u in usages)
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": drafted - accepted}
    return out


def _lp(value: float) -> float:
    return value if value > _LOGPROB_FLOOR else _LOGPROB_FLOOR  # also maps NaN and -inf


def chat_logprobs(items: Sequence[TokenLogprob]) -> dict[str, Any]:
    def entry(token: str, logprob: float, raw: bytes) -> dict[str, Any]:
        # the token's own bytes: part of a character where the token holds only part of one
        return {"token": token, "logprob": _lp(logprob), "bytes": list(raw or token.encode("utf-8"))}

    return {
        "content": [
            {**entry(t.token, t.logprob, t.raw),
             "top_logprobs": [entry(s, lp, r) for (_, s, lp), r in zip(t.top, t.top_raw or (b"",) * len(t.top),
                                                                       strict=True)]}
            for t in items
        ],
        "refusal": None,
    }


def completion_logprobs(items: Sequence[TokenLogprob], offset: int = 0) -> tuple[dict[str, Any], int]:
    """The legacy format; returns it with the text offset after the last token. A token
    that holds part of a character starts where that character does, and the text's
    offsets advance by the characters its bytes complete."""
    tokens, token_lps, tops, offsets = [], [], [], []
    chars = codecs.getincrementaldecoder("utf-8")("replace")
    for t in items:
        tokens.append(t.token)
        token_lps.append(_lp(t.logprob))
        tops.append({s: _lp(lp) for _, s, lp in t.top})
        offsets.append(offset)
        offset += len(chars.decode(t.raw)) if t.raw else len(t.token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def chat_response(rid: str, created: int, model: str, choices: Sequence[ChoiceResult], logprobs: bool) -> bytes:
    out = []
    for i, c in enumerate(choices):
        assert c.finished is not None
        content = "".join(c.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if c.reasoning:
            message["reasoning_content"] = "".join(c.reasoning)
        if c.tool_calls:
            message["content"] = content or None  # OpenAI's shape for a reply that is only calls
            message["tool_calls"] = [tool_call_dict(t) for t in c.tool_calls]
        out.append({
            "index": i,
            "message": message,
            "logprobs": chat_logprobs(c.logprobs) if logprobs else None,
            "finish_reason": c.finished.finish_reason,
        })
    return dumps({
        "id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
        "usage": total_usage([c.finished.usage for c in choices if c.finished is not None]),
    })


def tool_call_dict(call: ToolCall, *, index: bool = False) -> dict[str, Any]:
    """One entry of `message.tool_calls` (with `index`: of a stream's `delta.tool_calls`)."""
    out: dict[str, Any] = {"index": call.index} if index else {}
    out.update(id=call.id, type="function", function={"name": call.name, "arguments": call.arguments})
    return out


def completion_response(rid: str, created: int, model: str, choices: Sequence[ChoiceResult], logprobs: bool) -> bytes:
    out = []
    for i, c in enumerate(choices):
        assert c.finished is not None
        out.append({
            "index": i,
            "text": "".join(c.text),
            "logprobs": completion_logprobs(c.logprobs)[0] if logprobs else None,
            "finish_reason": c.finished.finish_reason,
        })
    return dumps({
        "id": rid, "object": "text_completion", "created": created, "model": model, "choices": out,
        "usage": total_usage([c.finished.usage for c in choices if c.finished is not None]),
    })


class ChunkTemplates:
    """The bytes of one streamed request's SSE events, precomputed per choice.

    `delta(i, text)` is the hot path: two byte concatenations around the
    json-escaped text. Chunks with logprobs, finish and usage chunks are rarer
    and built from dicts.
    """

    __slots__ = ("chat", "head", "include_usage", "_plain", "_first", "_suffix", "_offsets")

    def __init__(self, *, chat: bool, rid: str, created: int, model: str, n: int, include_usage: bool):
        self.chat = chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        self.head: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model}
        head = b"data: " + dumps(self.head)[:-1] + b',"choices":[{"index":'
        self.include_usage = include_usage  # OpenAI sends "usage": null on every chunk but the last
        tail = b',"usage":null}\n\n' if include_usage else b"}\n\n"
        if chat:
            self._plain = [head + b'%d,"delta":{"content":' % i for i in range(n)]
            self._first = [head + b'%d,"delta":{"role":"assistant","content":' % i for i in range(n)]
            self._suffix = b'},"logprobs":null,"finish_reason":null}]' + tail
        else:
            self._plain = self._first = [head + b'%d,"text":' % i for i in range(n)]
            self._suffix = b',"logprobs":null,"finish_reason":null}]' + tail
        self._offsets = [0] * n

    def delta(self, index: int, text: str, first: bool) -> bytes:
        return (self._first if first else self._plain)[index] + dumps(text) + self._suffix

    def delta_logprobs(self, index: int, text: str, first: bool, items: Sequence[TokenLogprob]) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(items), "finish_reason": None}
        else:
            lps, self._offsets[index] = completion_logprobs(items, self._offsets[index])
            choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": None}
        return self._event({"choices": [choice]})

    def tool_calls(self, index: int, calls: Sequence[ToolCall], first: bool) -> bytes:
        """Finished calls, whole: id, name and all the arguments in one `delta.tool_calls`
        chunk (OpenAI's clients accept that as they accept fragments), for families
        whose calls do not stream as `ToolCallDelta`s."""
        delta: dict[str, Any] = {"role": "assistant", "content": None} if first else {}
        delta["tool_calls"] = [tool_call_dict(c, index=True) for c in calls]
        return self._event({"choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]})

    def tool_call_delta(self, index: int, d: ToolCallDelta, first: bool, opening: bool) -> bytes:
        """A streamed call's piece, as vLLM and llama-server send it: its `opening` chunk
        has index, id, type, function.name and arguments ""; the others only index and
        an arguments fragment (clients join them by index)."""
        delta: dict[str, Any] = {"role": "assistant", "content": None} if first else {}
        if opening:
            entry: dict[str, Any] = {"index": d.index, "id": d.id, "type": "function",
                                     "function": {"name": d.name, "arguments": d.arguments}}
        else:
            entry = {"index": d.index, "function": {"arguments": d.arguments}}
        delta["tool_calls"] = [entry]
        return self._event({"choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]})

    def reasoning(self, index: int, text: str, first: bool) -> bytes:
        """Reasoning text, as `delta.reasoning_content` (vLLM's and mlx_lm.server's field)."""
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        delta["reasoning_content"] = text
        return self._event({"choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]})

    def finish(self, index: int, reason: str, role_sent: bool) -> bytes:
        if self.chat:
            delta = {} if role_sent else {"role": "assistant", "content": ""}
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": reason}
        return self._event({"choices": [choice]})

    def usage(self, usages: Sequence[Usage]) -> bytes:
        return b"data: " + dumps({**self.head, "choices": [], "usage": total_usage(usages)}) + b"\n\n"

    def _event(self, fields: dict[str, Any]) -> bytes:
        if self.include_usage:
            fields["usage"] = None
        return b"data: " + dumps({**self.head, **fields}) + b"\n\n"


class ChunkEncoder:
    """OpenAI's SSE chunks as the engine's events arrive: one more encoder for the pump
    (`_pump.StreamEncoder` for one choice, `_pump.ChoicesEncoder` for n). Each choice's
    first chunk carries the role, a streamed call's opening chunk its id and name, and
    the end the usage chunk (when asked) and [DONE]."""

    __slots__ = ("tpl", "logprobs", "_role_sent", "_streamed")

    def __init__(self, tpl: ChunkTemplates, n: int, logprobs: bool):
        self.tpl = tpl
        self.logprobs = logprobs
        self._role_sent = [False] * n
        # per choice, the calls whose deltas went out: their ToolCalls entry is not sent again
        self._streamed: list[set[int]] = [set() for _ in range(n)]

    def start(self) -> bytes:
        return b""

    def event(self, ev: Any) -> bytes:
        return self.event_at(0, ev)

    def finish(self, fin: Finished) -> bytes:
        return self.finish_at(0, fin) + self.close([fin])

    def error(self, err: HTTPError) -> bytes:
        """The error as the last event of a stream that already started, then [DONE]."""
        return b"data: " + err.body() + b"\n\n" + DONE

    def event_at(self, index: int, ev: Any) -> bytes:
        tpl = self.tpl
        if type(ev) is TextDelta:
            first = not self._role_sent[index]
            out = b""
            if ev.reasoning:
                out = tpl.reasoning(index, ev.reasoning, first)
                first = False
            if ev.text or (self.logprobs and ev.logprobs):  # the hot path: `tpl.delta`
                out += (tpl.delta_logprobs(index, ev.text, first, ev.logprobs or ()) if self.logprobs
                        else tpl.delta(index, ev.text, first))
            if out:
                self._role_sent[index] = True
            return out
        if type(ev) is ToolCallDelta:
            streamed = self._streamed[index]
            opening = ev.index not in streamed
            streamed.add(ev.index)
            out = tpl.tool_call_delta(index, ev, not self._role_sent[index], opening)
            self._role_sent[index] = True
            return out
        if type(ev) is ToolCalls:
            calls = [c for c in ev.calls if c.index not in self._streamed[index]]
            if not calls:
                return b""
            out = tpl.tool_calls(index, calls, not self._role_sent[index])
            self._role_sent[index] = True
            return out
        return b""

    def finish_at(self, index: int, fin: Finished) -> bytes:
        out = self.tpl.finish(index, fin.finish_reason, self._role_sent[index])
        self._role_sent[index] = True
        return out

    def close(self, fins: Sequence[Finished]) -> bytes:
        usage = self.tpl.usage([f.usage for f in fins]) if self.tpl.include_usage else b""
        return usage + DONE


class Completions:
    """The raw-ASGI handler of both OpenAI completion endpoints."""

    def __init__(self, app: ServerHost, pump: Pump):
        self.app = app
        self.pump = pump

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self.app
        settings = app.settings
        chat = scope["path"] == CHAT_PATH
        cors = scope_cors(scope, settings.cors_origins)
        if scope["method"] == "OPTIONS":
            await send_response(send, 204, b"", [(b"allow", b"POST, OPTIONS"), *cors])
            return
        rid = new_id("chatcmpl-" if chat else "cmpl-")
        rec = RequestRecord(request_id(scope, rid), scope["path"], trio.current_time())
        scope[REQUEST_ID] = rec.request_id
        extra = [(b"x-request-id", rec.request_id.encode()), *cors]
        try:
            req, streams = await self._admit(scope, receive, chat, rec)
        except Disconnected:
            rec.outcome = "disconnect"
            app.observe(rec)
            return
        except Exception as exc:
            await refuse(app, scope, send, exc, rec, extra)
            return
        rec.admitted = trio.current_time()
        rec.prompt_tokens = len(streams[0].prompt_tokens)
        model = answered_as(settings, pick_adapter(settings, req.model), req.model)
        # chat: a bool; completions: how many alternatives, so 0 asks for the chosen tokens' own
        logprobs = req.logprobs is not None and req.logprobs is not False
        if req.stream:
            tpl = ChunkTemplates(chat=chat, rid=rid, created=now(), model=model, n=req.n,
                                 include_usage=req.include_usage)
            await self.pump.serve_stream(receive, send, streams, ChunkEncoder(tpl, req.n, logprobs), rec, extra)
        else:
            respond = chat_response if chat else completion_response

            def build(results: Sequence[ChoiceResult]) -> bytes:
                return respond(rid, now(), model, results, logprobs)

            try:
                await self.pump.serve_whole(receive, send, streams, rec, extra, build, logprobs=logprobs)
            except Exception:
                log.exception("request %s failed", rec.request_id)
                rec.status, rec.outcome = 500, "failed"
                app.observe(rec)
                await send_error(send, HTTPError(500, "internal server error", type="server_error",
                                                 code="internal_error"), extra)

    async def _admit(
        self, scope: Scope, receive: Receive, chat: bool, rec: RequestRecord
    ) -> tuple[ChatCompletionRequest | CompletionRequest, list[RequestStream]]:
        app, settings = self.app, self.app.settings
        req: ChatCompletionRequest | CompletionRequest = await read_json_request(
            scope, receive, app, (ChatCompletionRequest if chat else CompletionRequest).model_validate)
        req.check(settings.max_n)
        batch, queue = settings.tuning.max_batch, settings.max_queue
        if req.n > batch + queue:  # its choices go in one by one: past this, a 429 however long it waits
            raise HTTPError(400, f"n must be at most {batch + queue} on this server: it decodes {batch} "
                            f"requests at once and queues {queue} more (--max-batch, --max-queue)",
                            param="n", code="invalid_value")
        adapter = pick_adapter(settings, req.model)
        rec.stream, rec.n = req.stream, req.n
        options = req.to_options()
        if adapter is not None:
            options = dataclasses.replace(options, adapter=adapter)
        seed = options.seed
        streams: list[RequestStream] = []

        async def start(engine: Engine) -> list[RequestStream]:
            try:
                for i in range(req.n):
                    if i > 0:  # tokenized and compiled once; choice i is the same request, seed + i
                        stream = streams[0].again(**({} if seed is None else {"seed": (seed + i) & _SEED_MASK}))
                    elif isinstance(req, ChatCompletionRequest):
                        stream = engine.chat([m.template_dict() for m in req.messages], options)
                    else:
                        stream = engine.generate(req.engine_prompt(), options)
                    await stream.__aenter__()
                    streams.append(stream)
            except BaseException:
                close_all(streams)
                raise
            return streams

        # a client that leaves while its request is admitted (a grammar checked, a long
        # prompt tokenized) cancels the admission
        async with app.engine_for(req.model) as engine:
            return req, await unless_disconnected(receive, partial(start, engine), close_all)
