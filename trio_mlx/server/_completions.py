"""POST /v1/chat/completions and /v1/completions, served on raw ASGI.

Why not a Quart route: (1) each SSE event should cost one `send` and nothing
more on the event loop (docs/design.md, rule 7); (2) a client that stops reading
blocks hypercorn's send inside a *shielded* cancel scope
(hypercorn/trio/tcp_server.py), so no deadline around a send can fire. So a
streamed response is written by a pump task in `app.nursery` while the
request's own ASGI task only waits for the client to disconnect. A watchdog
(`watch_stalls`) aborts a pump stuck in one send for `stall_timeout`
seconds: its sequences leave the batch at once, and the ASGI task returns,
which makes hypercorn close the connection and so unblocks the send.

Per-request timings land in a `RequestRecord` handed to `app.observers`
when the request ends: the hook for metrics.

The same machinery serves the other APIs (`_wire.py`: Anthropic's Messages
API, OpenAI's Responses API): `read_json_request` checks their requests, the
pump writes their streams through a `StreamEncoder`, and `_serve_whole` builds
their whole answers with their own builder and error shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import trio

from .._errors import TrioMLXError
from ..engine import Finished, RequestStream, TextDelta, ToolCallDelta, ToolCalls
from ._asgi import (
    JSON_HEADERS,
    REQUEST_ID,
    Disconnected,
    RawHeaders,
    Receive,
    Scope,
    Send,
    check_api_key,
    cors_headers,
    header,
    read_body,
    request_id,
    send_error,
    send_response,
    unless_disconnected,
    wait_disconnect,
)
from ._guard import BODY_READ, require_json, unread_body_close
from ._intake import off_loop, parse_request
from ._openai import (
    DONE,
    PING,
    ChatCompletionRequest,
    ChoiceResult,
    ChunkTemplates,
    CompletionRequest,
    HTTPError,
    chat_response,
    completion_response,
    error_from_exception,
    new_id,
    now,
)
from ._records import CHAT_PATH, RequestRecord, ServerHost

if TYPE_CHECKING:
    pass

T = TypeVar("T")
log = logging.getLogger("trio_mlx.http")
# The longest pause between two events of one stream that adaptive pacing may
# impose: coarser than this reads as a stall to a person watching. Judgement.
_MAX_GAP = 0.25
# A whole response with more logprob entries (tokens and their alternatives) than this is
# built off the event loop (`_intake.off_loop`): ~2.3 us an entry, so ~10 ms here. Judgement.
_LARGE_LOGPROBS = 4096

_SEED_MASK = 2**64 - 1
_SSE_HEADERS: RawHeaders = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class StreamEncoder(Protocol):
    """The bytes of one streamed answer of another API (`_wire.py`), made as the engine's
    events arrive (on the event loop, once per SSE event: keep it cheap, docs/design.md rule 7)."""

    def start(self) -> bytes:
        """The events sent before the first token (the response's opening)."""

    def event(self, ev: Any) -> bytes:
        """The events for one engine event other than `Finished` (may be empty)."""

    def finish(self, fin: Finished) -> bytes:
        """The closing events of an answer that ended normally."""

    def error(self, err: HTTPError) -> bytes:
        """The last event of a stream that failed after it started."""


class _Gone(Exception):
    """The stream was aborted (disconnect, stall, shutdown): stop writing."""


class Completions:
    """The raw-ASGI handler of both completion endpoints, and its streams' stall watchdog."""

    def __init__(self, app: ServerHost):
        self.app = app
        self.streams: set[_Stream] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self.app
        settings = app.settings
        chat = scope["path"] == CHAT_PATH
        cors = cors_headers(header(scope, b"origin"), settings.cors_origins,
                            preflight=scope["method"] == "OPTIONS")
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
        model = settings.served_model_name
        # chat: a bool; completions: how many alternatives, so 0 asks for the chosen tokens' own
        logprobs = req.logprobs is not None and req.logprobs is not False
        if req.stream:
            tpl = ChunkTemplates(chat=chat, rid=rid, created=now(), model=model, n=req.n,
                                 include_usage=req.include_usage)
            await self._serve_stream(receive, send, streams, tpl, rec, logprobs, extra)
        else:
            try:
                await self._serve_whole(receive, send, streams, chat, rid, rec, logprobs, extra)
            except Exception:
                log.exception("request %s failed", rec.request_id)
                rec.status, rec.outcome = 500, "failed"
                app.observe(rec)
                await send_error(send, HTTPError(500, "internal server error", type="server_error",
                                                 code="internal_error"), extra)

    # -- admission -------------------------------------------------------------

    async def _admit(
        self, scope: Scope, receive: Receive, chat: bool, rec: RequestRecord
    ) -> tuple[ChatCompletionRequest | CompletionRequest, list[RequestStream]]:
        app, settings = self.app, self.app.settings
        req: ChatCompletionRequest | CompletionRequest = await read_json_request(
            scope, receive, app, (ChatCompletionRequest if chat else CompletionRequest).model_validate)
        req.check(settings.max_n)
        if req.model is not None and req.model != settings.served_model_name:
            raise HTTPError(404, f"the model {req.model!r} does not exist; this server serves "
                            f"{settings.served_model_name!r}", param="model", code="model_not_found")
        rec.stream, rec.n = req.stream, req.n
        engine = app.ready_engine()
        opts = req.engine_options()
        seed = opts.get("seed")
        streams: list[RequestStream] = []

        async def start() -> list[RequestStream]:
            try:
                for i in range(req.n):
                    if i > 0:  # tokenized and compiled once; choice i is the same request, seed + i
                        stream = streams[0].again(**({} if seed is None else {"seed": (seed + i) & _SEED_MASK}))
                    elif isinstance(req, ChatCompletionRequest):
                        stream = engine.chat([m.template_dict() for m in req.messages], **opts)
                    else:
                        stream = engine.generate(req.engine_prompt(), **opts)
                    await stream.__aenter__()
                    streams.append(stream)
            except BaseException:
                close_all(streams)
                raise
            return streams

        return req, await unless_disconnected(receive, start, close_all)

    # -- whole responses -------------------------------------------------------

    async def _serve_whole(self, receive: Receive, send: Send, streams: list[RequestStream], chat: bool,
                           rid: str, rec: RequestRecord, logprobs: bool, extra: RawHeaders, *,
                           build: Callable[[Sequence[ChoiceResult]], bytes] | None = None,
                           render: Callable[[HTTPError], bytes] | None = None) -> None:
        """Collect the choices, then answer: `build` and `render` make the body and the error
        body of another API (`_wire.py`); by default, OpenAI's."""
        results = [ChoiceResult() for _ in streams]

        async def collect(stream: RequestStream, result: ChoiceResult) -> None:
            try:
                async for ev in stream:
                    if isinstance(ev, TextDelta):
                        if rec.first_token is None:
                            rec.first_token = trio.current_time()
                        result.text.append(ev.text)
                        if ev.reasoning:
                            result.reasoning.append(ev.reasoning)
                        if ev.logprobs:
                            result.logprobs.extend(ev.logprobs)
                    elif isinstance(ev, ToolCalls):
                        result.tool_calls.extend(ev.calls)
                    elif isinstance(ev, Finished):  # a whole answer takes calls whole, not their deltas
                        result.finished = ev
            finally:
                stream.close()

        gone = False

        def disconnected() -> None:
            nonlocal gone
            gone = True
            for stream in streams:
                stream.close("disconnect")
            nursery.cancel_scope.cancel()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait_disconnect, receive, disconnected)
                async with trio.open_nursery() as choices:
                    for stream, result in zip(streams, results, strict=True):
                        choices.start_soon(collect, stream, result)
                nursery.cancel_scope.cancel()
        finally:
            for stream in streams:
                stream.close()
            rec.ended = trio.current_time()
        if gone:
            rec.outcome = "disconnect"
            self.app.observe(rec)
            return
        fins = [r.finished for r in results]
        _record_finish(rec, [f for f in fins if f is not None])
        if any(f is None or f.finish_reason in ("abort", "error") for f in fins):
            bad = next((f for f in fins if f is not None and f.finish_reason in ("abort", "error")), None)
            error = _terminal_error(bad, rec)
            rec.status = error.status
            self.app.observe(rec)
            await send_error(send, error, extra, render)
            return
        if build is None:
            make = partial(chat_response if chat else completion_response,
                           rid, now(), self.app.settings.served_model_name, results, logprobs)
        else:
            make = partial(build, results)
        entries = sum(1 + len(lp.top) for r in results for lp in r.logprobs) if logprobs else 0
        body = make() if entries <= _LARGE_LOGPROBS else await off_loop(make)
        rec.status = 200
        self.app.observe(rec)
        await send_response(send, 200, body, [*JSON_HEADERS, *extra])

    # -- streams ---------------------------------------------------------------

    async def _serve_stream(self, receive: Receive, send: Send, streams: list[RequestStream],
                            tpl: ChunkTemplates | StreamEncoder, rec: RequestRecord, logprobs: bool, extra: RawHeaders) -> None:
        pump = _Stream(self, send, streams, tpl, rec, logprobs, [*_SSE_HEADERS, *extra])
        self.streams.add(pump)
        try:
            # Hypercorn's sends need this task alive (they use the connection's task group,
            # which closes when this task returns): wait until the pump is done, or aborted.
            with trio.CancelScope() as waiting:
                pump.on_done = waiting.cancel
                self.app.nursery.start_soon(pump.run)
                await wait_disconnect(receive, lambda: pump.abort("disconnect"))
                await trio.sleep_forever()  # a disconnect during the final send: let it finish
        finally:
            pump.abort("cancelled")  # a no-op unless the server cut this request

    async def watch_stalls(self) -> None:
        """Abort every stream whose client has not taken a chunk for stall_timeout seconds."""
        stall = self.app.settings.stall_timeout
        most = self.app.settings.max_unread_tokens
        period = min(1.0, stall / 4)  # the check's resolution; arbitrary
        while True:
            await trio.sleep(period)
            t = trio.current_time()
            for pump in list(self.streams):
                since = pump.sending_since
                if since is not None and t - since > stall:
                    log.warning("request %s: the client took no data for %.1f s; aborting it",
                                pump.rec.request_id, t - since)
                    pump.abort("stall")
                elif since is not None and most and (unread := sum(s.unread for s in pump.streams)) > most:
                    # Its socket is full and its tokens pile up in memory: bound them (stall_timeout
                    # alone would let a fast model buffer thousands of tokens for a client gone quiet).
                    log.warning("request %s: the client is %d tokens behind; aborting it",
                                pump.rec.request_id, unread)
                    pump.abort("stall")


async def refuse(app: ServerHost, scope: Scope, send: Send, exc: Exception, rec: RequestRecord,
                 extra: Sequence[tuple[bytes, bytes]], render: Callable[[HTTPError], bytes] | None = None) -> None:
    """A request that failed before it started: its error (in its API's shape: `render`),
    recorded; `Connection: close` when its body was not read (`_guard.unread_body_close`)."""
    error = error_from_exception(exc)
    if not isinstance(exc, (HTTPError, TrioMLXError)) and error.status >= 500:
        log.exception("request %s failed before it started", rec.request_id)
    rec.status, rec.outcome = error.status, "error"
    app.observe(rec)
    told = any(k.lower() == "connection" for k, _ in error.headers)
    await send_error(send, error, [*extra, *([] if told else unread_body_close(scope))], render)


async def read_json_request(scope: Scope, receive: Receive, app: ServerHost, into: Callable[[dict[str, Any]], T],
                            *, accept_x_api_key: bool = False) -> T:
    """A POST's JSON object body, after the method, API key and content type checks, turned
    `into` the API's request (every generation endpoint's first steps, whatever its API):
    cheap bounds first, a large body off the event loop (`_intake.py`)."""
    settings = app.settings
    if scope["method"] != "POST":
        raise HTTPError(405, f"method {scope['method']} is not allowed on {scope['path']}",
                        code="method_not_allowed", headers=[("Allow", "POST, OPTIONS")])
    check_api_key(header(scope, b"authorization"), settings.api_key,
                  x_api_key=header(scope, b"x-api-key"), accept_x_api_key=accept_x_api_key)
    require_json(scope)  # no preflight-free cross-origin POSTs (_guard.py)
    body = await read_body(scope, receive, settings.max_body_bytes, settings.body_timeout)
    scope[BODY_READ] = True
    return await parse_request(body, into, max_messages=settings.max_messages,
                               context_length=app.engine.context_length if app.engine is not None else 0)


def _record_finish(rec: RequestRecord, fins: list[Finished]) -> None:
    rec.finish_reasons = tuple(f.finish_reason for f in fins)
    rec.completion_tokens = sum(f.usage.completion_tokens for f in fins)
    if fins:
        rec.prompt_tokens = fins[0].usage.prompt_tokens
        rec.cached_tokens = fins[0].usage.cached_tokens


def _terminal_error(fin: Finished | None, rec: RequestRecord) -> HTTPError:
    """The error for a request the engine ended without a result."""
    if fin is not None and fin.finish_reason == "abort":
        rec.outcome = "aborted"
        return HTTPError(503, fin.error or "the request was aborted", type="server_error", code="aborted",
                         headers=[("Retry-After", "5")])
    rec.outcome = "failed"
    log.error("request %s failed on the engine: %s", rec.request_id, fin.error if fin else "no result")
    return HTTPError(500, "the model failed while generating this response", type="server_error",
                     code="generation_failed")


class _Stream:
    """One streamed response: the pump that writes it, and the controls the watchdog uses."""

    def __init__(self, owner: Completions, send: Send, streams: list[RequestStream],
                 tpl: ChunkTemplates | StreamEncoder,
                 rec: RequestRecord, logprobs: bool, headers: RawHeaders):
        self.owner = owner
        self._asgi_send = send
        self.streams = streams
        # OpenAI's byte templates, or another API's encoder (then `tpl` is unused).
        self.encoder: StreamEncoder | None = None if isinstance(tpl, ChunkTemplates) else tpl
        self.tpl = cast(ChunkTemplates, tpl)
        self.rec = rec
        self.logprobs = logprobs
        self.headers = headers
        self.ping = owner.app.settings.ping_interval
        self.interval = owner.app.settings.stream_interval
        self.event_rate = owner.app.settings.max_event_rate
        self.cancel_scope = trio.CancelScope()
        self.sending_since: float | None = None
        self.aborted: str | None = None
        self.finishing = False  # the final send has begun
        self.done = False
        self.on_done: Callable[[], object] = lambda: None

    def abort(self, cause: str) -> None:
        """Stop now: the sequences leave the batch at the actor's next step (sync, non-blocking)."""
        if self.done or self.aborted:
            return
        if self.finishing and cause != "stall":
            # Hypercorn reports a disconnect while it completes the final send (recycling the
            # connection for keep-alive); cancelling that would leave the connection open.
            return
        self.aborted = cause
        self.rec.outcome = cause
        self.cancel_scope.cancel()  # first, so no reader is waiting when the channels close
        for stream in self.streams:
            stream.close(cause)
        self.on_done()

    async def run(self) -> None:
        try:
            with self.cancel_scope:
                await self._run()
        except Exception:  # never let one request take the app nursery (and the server) down
            log.exception("streamed request %s failed", self.rec.request_id)
        finally:
            for stream in self.streams:
                stream.close()
            self.done = True
            self.owner.streams.discard(self)
            self.rec.ended = trio.current_time()
            self.owner.app.observe(self.rec)
            self.on_done()

    async def _run(self) -> None:
        self.rec.status = 200
        try:
            await self._send_raw({"type": "http.response.start", "status": 200, "headers": self.headers})
            if self.encoder is not None:
                await self._encoded(self.encoder)
            elif len(self.streams) == 1:
                await self._one()
            else:
                await self._many()
        except _Gone:
            pass
        except Exception:
            if self.aborted:
                return  # hypercorn complains about a send on a connection it closed; expected
            log.exception("streamed request %s failed", self.rec.request_id)
            self.rec.outcome = "failed"
            error = HTTPError(500, "internal server error", type="server_error", code="internal_error")
            try:
                await self._end(error.sse() if self.encoder is None else self.encoder.error(error))
            except Exception:
                pass

    async def _pace(self) -> None:
        """Wait before this stream's next event, so tokens arriving meanwhile coalesce.

        The event loop shares the GIL with the actor thread (docs/design.md, rule 7):
        every SSE event costs it a wake-up, a chunk and a send, whatever the
        number of tokens inside. Capping the total event rate at `max_event_rate`
        bounds that cost; each stream's gap grows with the number of open
        streams (up to _MAX_GAP). A lone stream keeps one event per step.

        The wait ends early once the engine has ended the request: its last
        tokens and its end go out at once. A client in a loop sends its next
        request only after this one ends, and meanwhile its slot in the batch
        is empty: measured on an H100 at 8 concurrent streams (1B), pacing
        held each stream's end back by ~40 ms, 4% of its life.
        """
        gap = self.interval
        if self.event_rate:
            gap = max(gap, min(len(self.owner.streams) / self.event_rate, _MAX_GAP))
        if gap:
            with trio.move_on_after(gap):
                for stream in self.streams:
                    await stream.wait_ended()

    async def _send_raw(self, message: dict[str, Any]) -> None:
        if self.aborted:
            raise _Gone
        self.sending_since = trio.current_time()
        await self._asgi_send(message)
        self.sending_since = None

    async def _send(self, body: bytes) -> None:
        await self._send_raw({"type": "http.response.body", "body": body, "more_body": True})

    async def _end(self, body: bytes) -> None:
        self.finishing = True
        await self._send_raw({"type": "http.response.body", "body": body, "more_body": False})

    def _final(self, fins: list[Finished], parts: list[bytes]) -> bytes:
        _record_finish(self.rec, fins)
        if self.tpl.include_usage:
            parts.append(self.tpl.usage([f.usage for f in fins]))
        parts.append(DONE)
        return b"".join(parts)

    async def _first(self, stream: RequestStream) -> Any:
        """The first event, with ': ping' comments while the request is queued or prefilling."""
        while True:
            with trio.move_on_after(self.ping):
                try:
                    return await stream.__anext__()
                except StopAsyncIteration:
                    raise _Gone from None
            await self._send(PING)

    async def _encoded(self, enc: StreamEncoder) -> None:
        """Another API's stream (`_wire.py`): one choice, whose events its encoder makes."""
        stream = self.streams[0]
        await self._send(enc.start())
        ev = await self._first(stream)
        while type(ev) is not Finished:
            data = enc.event(ev)
            if data:
                if self.rec.first_token is None:
                    self.rec.first_token = trio.current_time()
                await self._send(data)
                await self._pace()
            try:
                ev = await stream.__anext__()
            except StopAsyncIteration:
                raise _Gone from None
        if ev.finish_reason in ("abort", "error"):
            await self._end(enc.error(_terminal_error(ev, self.rec)))
        else:
            _record_finish(self.rec, [ev])
            await self._end(enc.finish(ev))

    async def _one(self) -> None:
        """The hot path: one choice; one `send` per engine wake-up."""
        stream = self.streams[0]
        tpl, send, logprobs, pace = self.tpl, self._send, self.logprobs, self._pace
        first = True
        streamed: set[int] = set()  # calls whose deltas went out: their ToolCalls entry is not sent again
        ev = await self._first(stream)
        while True:
            if type(ev) is TextDelta:
                if ev.reasoning:
                    if first:
                        self.rec.first_token = trio.current_time()
                    await send(tpl.reasoning(0, ev.reasoning, first))
                    first = False
                if ev.text or (logprobs and ev.logprobs):
                    if first:
                        self.rec.first_token = trio.current_time()
                    if logprobs:
                        await send(tpl.delta_logprobs(0, ev.text, first, ev.logprobs or ()))
                    else:
                        await send(tpl.delta(0, ev.text, first))
                    first = False
                    await pace()
            elif type(ev) is ToolCallDelta:
                if first:
                    self.rec.first_token = trio.current_time()
                opening = ev.index not in streamed
                streamed.add(ev.index)
                await send(tpl.tool_call_delta(0, ev, first, opening))
                first = False
                await pace()
            elif type(ev) is ToolCalls:
                calls = [c for c in ev.calls if c.index not in streamed]
                if calls:
                    if first:
                        self.rec.first_token = trio.current_time()
                    await send(tpl.tool_calls(0, calls, first))
                    first = False
            else:
                if ev.finish_reason in ("abort", "error"):
                    await self._end(_terminal_error(ev, self.rec).sse())
                else:
                    await self._end(self._final([ev], [tpl.finish(0, ev.finish_reason, not first)]))
                return
            try:
                ev = await stream.__anext__()
            except StopAsyncIteration:
                raise _Gone from None

    async def _many(self) -> None:
        """n > 1: one reader task per choice; what is waiting goes out as one send.

        The readers hand their events over unbuffered: each holds at most the one it
        took, and what the client has not taken waits in the choices' own channels,
        where `RequestStream.unread` counts it and the watchdog's cap sees the sum
        over the choices (an unbounded channel here held 32 MB for one client)."""
        n = len(self.streams)
        tpl, logprobs = self.tpl, self.logprobs
        role_sent = [False] * n
        streamed: list[set[int]] = [set() for _ in range(n)]  # per choice, as in `_one`
        fins: list[Finished] = []
        send_ch, recv_ch = trio.open_memory_channel[tuple[int, Any]](0)
        async with trio.open_nursery() as nursery:
            for i, stream in enumerate(self.streams):
                nursery.start_soon(_read, i, stream, send_ch.clone())
            send_ch.close()
            while len(fins) < n:
                try:
                    if self.rec.first_token is None:
                        with trio.move_on_after(self.ping) as timer:
                            batch = [await recv_ch.receive()]
                        if timer.cancelled_caught:
                            await self._send(PING)
                            continue
                    else:
                        batch = [await recv_ch.receive()]
                except trio.EndOfChannel:
                    raise _Gone from None
                while True:
                    try:
                        batch.append(recv_ch.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                parts: list[bytes] = []
                for i, ev in batch:
                    if type(ev) is TextDelta:
                        chunks = [tpl.reasoning(i, ev.reasoning, not role_sent[i])] if ev.reasoning else []
                        if ev.text or (logprobs and ev.logprobs):
                            first = not (role_sent[i] or chunks)
                            chunks.append(tpl.delta_logprobs(i, ev.text, first, ev.logprobs or ())
                                          if logprobs else tpl.delta(i, ev.text, first))
                        if chunks:
                            if self.rec.first_token is None:
                                self.rec.first_token = trio.current_time()
                            parts.extend(chunks)
                            role_sent[i] = True
                    elif type(ev) is ToolCallDelta:
                        if self.rec.first_token is None:
                            self.rec.first_token = trio.current_time()
                        opening = ev.index not in streamed[i]
                        streamed[i].add(ev.index)
                        parts.append(tpl.tool_call_delta(i, ev, not role_sent[i], opening))
                        role_sent[i] = True
                    elif type(ev) is ToolCalls:
                        calls = [c for c in ev.calls if c.index not in streamed[i]]
                        if calls:
                            if self.rec.first_token is None:
                                self.rec.first_token = trio.current_time()
                            parts.append(tpl.tool_calls(i, calls, not role_sent[i]))
                            role_sent[i] = True
                    elif ev.finish_reason in ("abort", "error"):
                        parts.append(_terminal_error(ev, self.rec).sse())
                        await self._end(b"".join(parts))
                        nursery.cancel_scope.cancel()
                        return
                    else:
                        fins.append(ev)
                        parts.append(tpl.finish(i, ev.finish_reason, role_sent[i]))
                        role_sent[i] = True
                if len(fins) == n:
                    await self._end(self._final(fins, parts))
                elif parts:
                    await self._send(b"".join(parts))
                    await self._pace()


def close_all(streams: Sequence[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def _read(index: int, stream: RequestStream, out: trio.MemorySendChannel[tuple[int, Any]]) -> None:
    with out:
        try:
            async for ev in stream:
                await out.send((index, ev))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # closed by an abort
