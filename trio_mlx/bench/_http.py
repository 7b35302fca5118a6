"""The HTTP side of `trio-mlx bench`: one streaming request, timed, over trio.

`SSEReader` turns a response's server-sent events into a `RequestRecord`;
`RawClient` (the default) is a minimal HTTP/1.1 client on trio sockets that
costs about half the CPU per streamed event of `HttpxClient` (measured:
~95 vs ~160-225 us per token on the 2-core dev box), which matters because
the load generator shares the host's CPU with the server it measures. Every
failure becomes a reason category on the record (`categorize`), never an
exception out of `stream_request`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from ._stats import RequestRecord, check_length

try:
    import orjson

    loads: Callable[[bytes], Any] = orjson.loads
    dumps: Callable[[Any], bytes] = orjson.dumps
except ImportError:  # pragma: no cover - orjson is optional
    loads = json.loads

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()


class HTTPStatusError(Exception):
    """The server answered with a status other than 200."""

    def __init__(self, status: int, text: str):
        super().__init__(f"HTTP {status}: {text}")
        self.status = status
        self.text = text


class ConnectFailed(Exception):
    """No connection could be opened to the server."""


class ProtocolViolation(Exception):
    """The server's response was malformed or cut off mid-body."""


class _StaleConnection(Exception):
    """A reused keep-alive connection was closed by the server before answering."""


def categorize(exc: BaseException) -> str:
    """The reason category an exception counts under (httpx's, trio's, the OS's or ours)."""
    import trio

    if isinstance(exc, HTTPStatusError):
        return f"http_{exc.status}"
    if isinstance(exc, trio.TooSlowError):
        return "timeout"
    if isinstance(exc, ConnectFailed | ConnectionRefusedError):
        return "connect"
    if isinstance(exc, ProtocolViolation):
        return "protocol"
    if isinstance(exc, ConnectionError | trio.BrokenResourceError):
        return "reset"
    if isinstance(exc, ValueError):  # json/orjson decode errors: a payload that is not JSON
        return "bad_payload"
    if type(exc).__module__.startswith("httpx"):
        import httpx

        if isinstance(exc, httpx.ConnectError):
            return "connect"
        if isinstance(exc, httpx.TimeoutException):
            return "timeout"
        if isinstance(exc, httpx.RemoteProtocolError):
            return "protocol"
        if isinstance(exc, httpx.ReadError | httpx.WriteError):
            return "reset"
        return "http_other"
    return "client_" + type(exc).__name__


class SSEReader:
    """Turns one response's server-sent events into its RequestRecord: the per-token hot path.

    One `feed()` per network read: split off complete lines, parse each
    `data:` payload once, and time content-bearing events with the read's
    timestamp. Comments (`: keepalive`), `event:`/`id:` lines and blank
    separators are skipped without parsing.
    """

    __slots__ = ("rec", "buf", "last", "done", "usage_tokens")

    def __init__(self, rec: RequestRecord):
        self.rec = rec
        self.buf = b""
        self.last = 0.0
        self.done = False
        self.usage_tokens: int | None = None

    def feed(self, data: bytes, now: float) -> None:
        """Consume bytes read `now` seconds after the request was sent."""
        if b"\n" not in data:
            self.buf += data
            return
        *lines, self.buf = (self.buf + data).split(b"\n")
        rec = self.rec
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            obj = loads(payload)
            if obj.get("error"):
                rec.error, rec.message = "stream_error", str(obj["error"])[:300]
                continue
            usage = obj.get("usage")
            if usage:
                self.usage_tokens = usage.get("completion_tokens")
            for ch in obj.get("choices") or ():
                text = ch.get("text")
                if text is None:
                    delta = ch.get("delta") or {}
                    text = (
                        delta.get("content")
                        or delta.get("reasoning_content")
                        or delta.get("reasoning")
                    )
                if text:
                    if rec.ttft is None:
                        rec.ttft = now
                    else:
                        rec.itl.append(now - self.last)
                    self.last = now
                    rec.events += 1
                if ch.get("finish_reason"):
                    rec.finish_reason = ch["finish_reason"]

    def finish(self, max_tokens: int) -> RequestRecord:
        rec = self.rec
        # Token counts come from `usage` (stream_options.include_usage); without
        # it the count of content events, a lower bound, stands in.
        rec.output_tokens = self.usage_tokens if self.usage_tokens is not None else rec.events
        if rec.error is None and not self.done:
            rec.error, rec.message = "incomplete", "the stream ended without data: [DONE]"
        check_length(rec, max_tokens)
        return rec


Sink = Callable[[bytes, float], None]


class _Conn:
    __slots__ = ("stream", "leftover")

    def __init__(self, stream: Any):
        self.stream = stream
        self.leftover = b""


class RawClient:
    """A minimal HTTP/1.1 client on trio sockets: the default, for its low CPU per event.

    httpx costs ~100-200 us of CPU per streamed read (measured on this
    project's 2-core dev box), enough for the load generator to become the
    bottleneck at thousands of tokens/s on a GPU host. This client speaks only
    what the bench needs: plain http, keep-alive, chunked / content-length /
    read-until-close bodies, and one retry when a reused idle connection
    turns out to have been closed by the server.
    """

    def __init__(self, base: str):
        from urllib.parse import urlsplit

        u = urlsplit(base)
        if u.scheme != "http" or not u.hostname:
            raise SystemExit(
                f"--client raw speaks plain http only, got {base!r}: use --client httpx"
            )
        self.host, self.port = u.hostname, u.port or 80
        self.prefix = u.path.rstrip("/")
        self._hostport = f"{self.host}:{self.port}".encode()
        self._idle: list[_Conn] = []

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.stream.aclose()

    async def _connect(self) -> _Conn:
        import trio

        try:
            return _Conn(await trio.open_tcp_stream(self.host, self.port))
        except OSError as exc:
            raise ConnectFailed(f"{type(exc).__name__}: {exc}") from exc

    def _head(self, method: bytes, path: str, body: bytes, extra: bytes = b"") -> bytes:
        return (
            method + b" " + (self.prefix + path).encode() + b" HTTP/1.1\r\nHost: " + self._hostport
            + b"\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n"
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n"
        )  # fmt: skip

    async def get_json(self, path: str) -> Any:
        conn = await self._connect()
        try:
            await conn.stream.send_all(self._head(b"GET", path, b"", b"Connection: close\r\n"))
            parts: list[bytes] = []
            status, _ = await self._response(conn, lambda d, _t: parts.append(d), reused=False)
        finally:
            await conn.stream.aclose()
        if status != 200:
            raise HTTPStatusError(status, b"".join(parts)[:300].decode(errors="replace"))
        return loads(b"".join(parts))

    async def stream(self, path: str, body: bytes, sink: Sink, t0: float) -> None:
        import trio

        request = self._head(b"POST", path, body) + body
        parts: list[bytes] = []  # the body of a response other than 200

        def collect(d: bytes, _t: float) -> None:
            parts.append(d)

        def route(d: bytes, t: float) -> None:
            sink(d, t - t0)

        for attempt in (0, 1):
            reused = bool(self._idle) and attempt == 0
            conn = self._idle.pop() if reused else await self._connect()
            try:
                try:
                    await conn.stream.send_all(request)
                except (trio.BrokenResourceError, ConnectionError):
                    if reused:
                        raise _StaleConnection() from None
                    raise
                status, keep = await self._response(conn, route, reused=reused, other=collect)
            except _StaleConnection:
                await conn.stream.aclose()
                continue
            except BaseException:
                await conn.stream.aclose()
                raise
            if keep:
                self._idle.append(conn)
            else:
                await conn.stream.aclose()
            if status != 200:
                raise HTTPStatusError(status, b"".join(parts)[:300].decode(errors="replace"))
            return

    async def _response(
        self, conn: _Conn, sink: Sink, *, reused: bool, other: Sink | None = None
    ) -> tuple[int, bool]:
        """Read one response; body bytes of a 200 go to `sink`, others' to `other`. (status, reusable)."""
        import trio

        clock = time.perf_counter
        recv = conn.stream.receive_some
        buf = conn.leftover
        conn.leftover = b""
        got_any = bool(buf)
        while True:  # skip 1xx interim responses
            while (i := buf.find(b"\r\n\r\n")) < 0:
                try:
                    data = await recv(65536)
                except (trio.BrokenResourceError, ConnectionError):
                    if reused and not got_any:
                        raise _StaleConnection() from None
                    raise
                if not data:
                    if reused and not got_any:
                        raise _StaleConnection()
                    raise ProtocolViolation("the server closed the connection before a response")
                got_any = True
                buf += data
                if len(buf) > 65536:
                    raise ProtocolViolation("response head over 64 KiB")
            lines = buf[:i].split(b"\r\n")
            buf = buf[i + 4 :]
            try:
                version, code = lines[0].split(b" ", 2)[:2]
                status = int(code)
            except ValueError:
                raise ProtocolViolation(f"bad status line {lines[0][:80]!r}") from None
            if not 100 <= status < 200:
                break
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip().lower()
        if status != 200 and other is not None:
            sink = other
        keep = version == b"HTTP/1.1" and b"close" not in headers.get(b"connection", b"")
        now = clock()
        if status in (204, 304):  # no body, whatever the headers say
            conn.leftover = buf
            return status, keep
        if b"chunked" in headers.get(b"transfer-encoding", b""):
            conn.leftover = await _read_chunked(recv, buf, sink, now)
            return status, keep
        if b"content-length" in headers:
            left = int(headers[b"content-length"])
            while True:
                piece = buf[:left]
                if piece:
                    sink(piece, now)
                left -= len(piece)
                if left == 0:
                    conn.leftover = buf[len(piece) :]
                    return status, keep
                buf = await recv(65536)
                now = clock()
                if not buf:
                    raise ProtocolViolation("the server closed the connection mid-body")
        while True:  # no framing: the body runs until the server closes (HTTP/1.0 style)
            if buf:
                sink(buf, now)
            buf = await recv(65536)
            now = clock()
            if not buf:
                return status, False


async def _read_chunked(
    recv: Callable[[int], Any], pending: bytes, sink: Sink, now: float
) -> bytes:
    """Decode a chunked body into `sink`, one call per network read; the bytes left after it."""
    clock = time.perf_counter
    while True:
        out: list[bytes] = []
        while (j := pending.find(b"\r\n")) >= 0:
            try:
                size = int(pending[:j].split(b";", 1)[0], 16)
            except ValueError:
                raise ProtocolViolation(f"bad chunk size {pending[:j][:40]!r}") from None
            if size == 0:
                rest = pending[j + 2 :]
                if rest.startswith(b"\r\n"):
                    if out:
                        sink(b"".join(out), now)
                    return rest[2:]
                if (k := rest.find(b"\r\n\r\n")) >= 0:  # trailers
                    if out:
                        sink(b"".join(out), now)
                    return rest[k + 4 :]
                break
            end = j + 2 + size
            if len(pending) < end + 2:
                break
            out.append(pending[j + 2 : end])
            pending = pending[end + 2 :]
        if out:
            sink(b"".join(out), now)
        data = await recv(65536)
        now = clock()
        if not data:
            raise ProtocolViolation("the server closed the connection mid-body")
        pending += data


class HttpxClient:
    """The same interface over httpx (`--client httpx`): https, proxies, and a cross-check."""

    def __init__(self, base: str, peak: int | None, timeout: float):
        import httpx

        self.base = base
        n = (peak + 8) if peak else None  # rate mode: as many connections as arrive
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n or 512),
            timeout=httpx.Timeout(timeout, connect=30.0, pool=None),
            trust_env=False,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def get_json(self, path: str) -> Any:
        resp = await self._client.get(self.base + path)
        if resp.status_code != 200:
            raise HTTPStatusError(resp.status_code, resp.text[:300])
        return resp.json()

    async def stream(self, path: str, body: bytes, sink: Sink, t0: float) -> None:
        clock = time.perf_counter
        headers = {"content-type": "application/json", "accept": "text/event-stream"}
        async with self._client.stream(
            "POST", self.base + path, content=body, headers=headers
        ) as resp:
            if resp.status_code != 200:
                text = (await resp.aread())[:300].decode(errors="replace")
                raise HTTPStatusError(resp.status_code, text)
            async for chunk in resp.aiter_bytes():
                sink(chunk, clock() - t0)


async def stream_request(
    client: RawClient | HttpxClient, path: str, body: bytes, max_tokens: int, limit_s: float
) -> RequestRecord:
    """Send one streaming request and time it. Never raises for a failed request: it records why."""
    import trio

    rec = RequestRecord()
    reader = SSEReader(rec)
    t0 = time.perf_counter()
    try:
        with trio.fail_after(limit_s):
            await client.stream(path, body, reader.feed, t0)
        rec.e2e = time.perf_counter() - t0
    except Exception as exc:
        rec.error = categorize(exc)
        rec.message = f"{type(exc).__name__}: {exc}"[:300]
    return reader.finish(max_tokens)
