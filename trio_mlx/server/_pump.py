"""The machinery every generation endpoint shares, on raw ASGI: the stream pump and the stall watchdog.

OpenAI's completions (`openai/`), Anthropic's Messages (`anthropic/`) and OpenAI's
Responses (`responses/`) read and check their request with `read_json_request`,
refuse it with `refuse` (in their error shape), and answer through one `Pump`:
`serve_whole` collects the choices and builds the body with the API's builder;
`serve_stream` writes a stream through the API's encoder (`StreamEncoder`, or a
`ChoicesEncoder` for n choices), with pings while queued, pacing, and aborts on
disconnect.

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
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar, cast

import trio

from .._errors import TrioMLXError
from ..engine import (
    Finished,
    GenerationOptions,
    RequestStream,
    TextDelta,
    TokenLogprob,
    ToolCall,
    ToolCalls,
)
from ._asgi import (
    JSON_HEADERS,
    RawHeaders,
    Receive,
    Scope,
    Send,
    check_api_key,
    header,
    read_body,
    send_error,
    send_response,
    wait_disconnect,
)
from ._guard import BODY_READ, require_json, unread_body_close
from ._http import HTTPError, error_from_exception
from ._intake import off_loop, parse_request
from ._records import RequestRecord, ServerHost

T = TypeVar("T")
log = logging.getLogger("trio_mlx.http")
# The longest pause between two events of one stream that adaptive pacing may
# impose: coarser than this reads as a stall to a person watching. Judgement.
_MAX_GAP = 0.25
# A whole response with more logprob entries (tokens and their alternatives) than this is
# built off the event loop (`_intake.off_loop`): ~2.3 us an entry, so ~10 ms here. Judgement.
_LARGE_LOGPROBS = 4096

PING = b": ping\n\n"
_SSE_HEADERS: RawHeaders = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class StreamEncoder(Protocol):
    """The bytes of one streamed answer in an API's shape, made as the engine's events
    arrive (on the event loop, once per SSE event: keep it cheap, docs/design.md rule 7)."""

    def start(self) -> bytes:
        """The events sent before the first token (the response's opening)."""

    def event(self, ev: Any) -> bytes:
        """The events for one engine event other than `Finished` (may be empty)."""

    def finish(self, fin: Finished) -> bytes:
        """The closing events of an answer that ended normally."""

    def error(self, err: HTTPError) -> bytes:
        """The last event of a stream that failed after it started."""


class ChoicesEncoder(Protocol):
    """The bytes of a streamed answer of n choices (OpenAI's `n`), in one stream."""

    def event_at(self, index: int, ev: Any) -> bytes:
        """The events for choice `index`'s engine event other than `Finished` (may be empty)."""

    def finish_at(self, index: int, fin: Finished) -> bytes:
        """The closing events of choice `index`, which ended normally."""

    def close(self, fins: Sequence[Finished]) -> bytes:
        """The stream's last events, once every choice has finished."""

    def error(self, err: HTTPError) -> bytes:
        """The last event of a stream that failed after it started."""


class ChoiceResult:
    """What one choice of a non-streamed request accumulated."""

    __slots__ = ("reasoning", "logprobs", "tool_calls", "finished", "_parts")

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.tool_calls: list[ToolCall] = []
        self.finished: Finished | None = None
        self._parts: list[list[str] | ToolCall] = []  # runs of text and calls, as generated

    def take(self, ev: Any) -> None:
        """Add one of the choice's events; a whole answer takes calls whole, not their deltas."""
        if isinstance(ev, TextDelta):
            if self._parts and type(self._parts[-1]) is list:
                self._parts[-1].append(ev.text)
            else:
                self._parts.append([ev.text])
            if ev.reasoning:
                self.reasoning.append(ev.reasoning)
            if ev.logprobs:
                self.logprobs.extend(ev.logprobs)
        elif isinstance(ev, ToolCalls):
            self.tool_calls.extend(ev.calls)
            self._parts.extend(ev.calls)
        elif isinstance(ev, Finished):
            self.finished = ev

    @property
    def text(self) -> list[str]:
        """The answer's text, in pieces (its calls left out)."""
        return [piece for p in self._parts if isinstance(p, list) for piece in p]

    def in_order(self) -> list[str | ToolCall]:
        """The answer's text runs (non-empty) and calls in the order the model wrote them: the
        blocks (Anthropic) or items (Responses) of a whole answer, in its stream's order."""
        runs = ("".join(p) if isinstance(p, list) else p for p in self._parts)
        return [r for r in runs if r != ""]



class _Gone(Exception):
    """The stream was aborted (disconnect, stall, shutdown): stop writing."""


class Pump:
    """Every API's whole answers and streams, and the streams' stall watchdog."""

    def __init__(self, app: ServerHost):
        self.app = app
        self.streams: set[_Stream] = set()
        # Seconds the event loop was held up past the stall watchdog's ticks, summed
        # (`watch_stalls`): time in which no client could have been sent anything.
        self.paused = 0.0

    # -- whole responses -------------------------------------------------------

    async def serve_whole(self, receive: Receive, send: Send, streams: list[RequestStream], rec: RequestRecord,
                          extra: RawHeaders, build: Callable[[Sequence[ChoiceResult]], bytes], *,
                          logprobs: bool = False, render: Callable[[HTTPError], bytes] | None = None) -> None:
        """Collect the choices, then answer: `build` makes the API's body of them, `render`
        its error body (None: OpenAI's shape); `logprobs`: the choices carry them."""
        results = [ChoiceResult() for _ in streams]

        async def collect(stream: RequestStream, result: ChoiceResult) -> None:
            try:
                async for ev in stream:
                    if rec.first_token is None and isinstance(ev, TextDelta):
                        rec.first_token = trio.current_time()
                    result.take(ev)
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
        make = partial(build, results)
        entries = sum(1 + len(lp.top) for r in results for lp in r.logprobs) if logprobs else 0
        body = make() if entries <= _LARGE_LOGPROBS else await off_loop(make)
        rec.status = 200
        self.app.observe(rec)
        await send_response(send, 200, body, [*JSON_HEADERS, *extra])

    # -- streams ---------------------------------------------------------------

    async def serve_stream(self, receive: Receive, send: Send, streams: list[RequestStream],
                           encoder: StreamEncoder | ChoicesEncoder, rec: RequestRecord, extra: RawHeaders) -> None:
        """Stream the choices through `encoder` (a `ChoicesEncoder` when there are several)."""
        pump = _Stream(self, send, streams, encoder, rec, [*_SSE_HEADERS, *extra])
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
        """Abort every stream whose client has not taken a chunk for stall_timeout seconds.

        A send counts as waiting on its client only while the event loop ran: where the
        loop itself was held up (a tick of this watchdog came late), no send could go out
        whatever the client did, and that time is the server's. Without that, one pause of
        the loop longer than the timeout (a loaded host) cut every stream whose send was
        under way as it began, however promptly its client read."""
        stall = self.app.settings.stall_timeout
        most = self.app.settings.max_unread_tokens
        period = min(1.0, stall / 4)  # the check's resolution; arbitrary
        last = trio.current_time()
        while True:
            await trio.sleep(period)
            t = trio.current_time()
            self.paused += max(0.0, t - last - period)
            last = t
            for pump in list(self.streams):
                since = pump.sending_since
                if since is not None and (waited := t - since - (self.paused - pump.paused_at)) > stall:
                    log.warning("request %s: the client took no data for %.1f s; aborting it",
                                pump.rec.request_id, waited)
                    pump.abort("stall")
                elif since is not None and most and (unread := sum(s.unread for s in pump.streams)) > most:
                    # Its socket is full and its tokens pile up in memory: bound them (stall_timeout
                    # alone would let a fast model buffer thousands of tokens for a client gone quiet).
                    log.warning("request %s: the client is %d tokens behind; aborting it",
                                pump.rec.request_id, unread)
                    pump.abort("stall")


def forget_frames(exc: BaseException) -> None:
    """Drop the tracebacks of `exc` and of the exceptions it was raised from. A refusal's
    traceback holds the frames that held the request (its body, its messages: megabytes, for
    some), and a frame on the way that kept the exception itself makes a reference cycle
    (trio and its thread hops make several): the whole request would then stay in memory
    until a full garbage collection, which an idle server may not run for minutes. Without
    the tracebacks the frames go by reference counting, with the response."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)


async def refuse(app: ServerHost, scope: Scope, send: Send, exc: Exception, rec: RequestRecord,
                 extra: Sequence[tuple[bytes, bytes]], render: Callable[[HTTPError], bytes] | None = None) -> None:
    """A request that failed before it started: its error (in its API's shape: `render`),
    recorded; `Connection: close` when its body was not read (`_guard.unread_body_close`)."""
    error = error_from_exception(exc)
    if not isinstance(exc, (HTTPError, TrioMLXError)) and error.status >= 500:
        log.exception("request %s failed before it started", rec.request_id)
    forget_frames(exc)
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
    key = check_api_key(header(scope, b"authorization"), settings.api_key,
                        x_api_key=header(scope, b"x-api-key"), accept_x_api_key=accept_x_api_key)
    require_json(scope)  # no preflight-free cross-origin POSTs (_guard.py)
    body = await read_body(scope, receive, settings.max_body_bytes, settings.body_timeout)
    scope[BODY_READ] = True
    call = await parse_request(body, into, max_messages=settings.max_messages,
                               context_length=app.engine.context_length if app.engine is not None else 0)
    if key is not None and settings.prompt_cache_isolation == "key":
        salt_by_key(call, key)
    return call


def salt_by_key(call: Any, key: str) -> None:
    """Put a request under its API key's part of the prompt cache (`prompt_cache_isolation`
    "key"): its cache_salt becomes the key's digest (never the key itself), followed by the
    request's own salt if any. `call` is a request model whose options are built later
    (OpenAI's: its `cache_salt`) or a call holding them (`options`)."""
    part = "key:" + hashlib.sha256(key.encode()).hexdigest()[:32]
    options = getattr(call, "options", None)
    if isinstance(options, GenerationOptions):
        own = options.cache_salt
        call.options = dataclasses.replace(options, cache_salt=part + ("/" + own if own else ""))
    elif hasattr(call, "cache_salt"):
        call.cache_salt = part + ("/" + call.cache_salt if call.cache_salt else "")


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

    def __init__(self, owner: Pump, send: Send, streams: list[RequestStream],
                 encoder: StreamEncoder | ChoicesEncoder, rec: RequestRecord, headers: RawHeaders):
        self.owner = owner
        self._asgi_send = send
        self.streams = streams
        self.encoder = encoder
        self.rec = rec
        self.headers = headers
        self.ping = owner.app.settings.ping_interval
        self.interval = owner.app.settings.stream_interval
        self.event_rate = owner.app.settings.max_event_rate
        self.cancel_scope = trio.CancelScope()
        self.sending_since: float | None = None
        self.paused_at = 0.0  # the owner's `paused` as the send under way began
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
            if len(self.streams) == 1:
                await self._one(cast(StreamEncoder, self.encoder))
            else:
                await self._many(cast(ChoicesEncoder, self.encoder))
        except _Gone:
            pass
        except Exception:
            if self.aborted:
                return  # hypercorn complains about a send on a connection it closed; expected
            log.exception("streamed request %s failed", self.rec.request_id)
            self.rec.outcome = "failed"
            error = HTTPError(500, "internal server error", type="server_error", code="internal_error")
            try:
                await self._end(self.encoder.error(error))
            except Exception:
                pass

    def _gap(self) -> float:
        """The least time between the starts of this stream's events (a send's own time is
        no part of it), so that tokens arriving meanwhile coalesce.

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
        return gap

    async def _pace(self, not_before: float, first: Any) -> None:
        """n > 1: after `first` came in (a choice's event), wait until `not_before`, or until
        the choices have all ended, so that what comes meanwhile joins its send. As
        `RequestStream.next_event` paces one choice: no timer for an event that came after
        `not_before`, nor for a choice's end."""
        if type(first) is not Finished and trio.current_time() < not_before:
            with trio.move_on_at(not_before):
                for stream in self.streams:
                    await stream.wait_ended()

    async def _send_raw(self, message: dict[str, Any]) -> None:
        if self.aborted:
            raise _Gone
        self.sending_since, self.paused_at = trio.current_time(), self.owner.paused
        await self._asgi_send(message)
        self.sending_since = None

    async def _send(self, body: bytes) -> None:
        await self._send_raw({"type": "http.response.body", "body": body, "more_body": True})

    async def _end(self, body: bytes) -> None:
        self.finishing = True
        await self._send_raw({"type": "http.response.body", "body": body, "more_body": False})

    async def _first(self, stream: RequestStream) -> Any:
        """The first event, with ': ping' comments while the request is queued or prefilling."""
        while True:
            with trio.move_on_after(self.ping):
                try:
                    return await stream.__anext__()
                except StopAsyncIteration:
                    raise _Gone from None
            await self._send(PING)

    async def _one(self, enc: StreamEncoder) -> None:
        """The hot path: one choice, whose events its API's encoder makes; one `send` per
        engine wake-up."""
        stream = self.streams[0]
        if opening := enc.start():
            await self._send(opening)
        ev = await self._first(stream)
        while type(ev) is not Finished:
            data = enc.event(ev)
            not_before = 0.0  # paced by the stream itself: no timer while tokens come slower
            if data:
                now = trio.current_time()
                if self.rec.first_token is None:
                    self.rec.first_token = now
                if gap := self._gap():
                    not_before = now + gap  # from this event's start: its send is not a gap
                await self._send(data)
            try:
                ev = await stream.next_event(not_before)
            except StopAsyncIteration:
                raise _Gone from None
        if ev.finish_reason in ("abort", "error"):
            await self._end(enc.error(_terminal_error(ev, self.rec)))
        else:
            _record_finish(self.rec, [ev])
            await self._end(enc.finish(ev))

    async def _many(self, enc: ChoicesEncoder) -> None:
        """n > 1: one reader task per choice; what is waiting goes out as one send.

        The readers hand their events over unbuffered: each holds at most the one it
        took, and what the client has not taken waits in the choices' own channels,
        where `RequestStream.unread` counts it and the watchdog's cap sees the sum
        over the choices (an unbounded channel here held 32 MB for one client). The
        gap between sends runs from a send's start (`_pace`)."""
        n = len(self.streams)
        fins: list[Finished] = []
        not_before = 0.0
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
                        await self._pace(not_before, batch[0][1])
                except trio.EndOfChannel:
                    raise _Gone from None
                while True:
                    try:
                        batch.append(recv_ch.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                parts: list[bytes] = []
                for i, ev in batch:
                    if type(ev) is not Finished:
                        if data := enc.event_at(i, ev):
                            if self.rec.first_token is None:
                                self.rec.first_token = trio.current_time()
                            parts.append(data)
                    elif ev.finish_reason in ("abort", "error"):
                        parts.append(enc.error(_terminal_error(ev, self.rec)))
                        await self._end(b"".join(parts))
                        nursery.cancel_scope.cancel()
                        return
                    else:
                        fins.append(ev)
                        parts.append(enc.finish_at(i, ev))
                if len(fins) == n:
                    _record_finish(self.rec, fins)
                    parts.append(enc.close(fins))
                    await self._end(b"".join(parts))
                elif parts:
                    not_before = trio.current_time() + self._gap()  # from this send's start
                    await self._send(b"".join(parts))


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
