"""File descriptors: the open-file limit, a cap on connections, and a quiet accept loop.

Every connection is a file descriptor. With the limit reached, `accept()`
fails with EMFILE: new clients hang in the listen queue while trio's accept
loop logs an ERROR with a traceback ten times a second, and the model's own
files, pipes and sockets can fail to open. So:

- at startup the soft open-file limit is raised to the hard one (importing
  mlx-lm no longer lowers either: `trio_mlx/_fdlimit.py`);
- `trio-mlx serve` caps concurrent connections below it (`max_connections`;
  by default the soft limit less a reserve for everything else): a
  connection over the cap is answered at once with 503 and `Retry-After`
  and closed, instead of holding a descriptor until the limit breaks accept;
- accept errors are logged once per `AcceptErrorFilter.interval` seconds with
  the count suppressed, not ten times a second.

The cap wraps hypercorn's per-connection handler (`hypercorn.trio.run.TCPServer`,
the name its trio worker calls for each accepted stream): hypercorn has no
connection limit of its own. `tests/unit/test_connections.py` pins that name.
Under other ASGI servers use theirs (uvicorn `--limit-concurrency`).

The same wrapper hands hypercorn each connection's stream with its sends taken
one at a time (`OneSender`). Hypercorn 0.18's trio worker sends under a lock,
but half-closes the stream (`send_eof`, when the client ends the connection)
outside it, and trio's `send_eof` yields while it holds the stream's sending
side: an HTTP/2 response still being written then raised `BusyResourceError`
out of the connection's task group and ended the whole server. sglang-router's
probe of each worker (a gRPC health check, HTTP/2 without TLS, then a GOAWAY)
did that to a replica now and then.

And one connection's failure inside hypercorn ends that connection, never the server
(`ConnectionGate`): hypercorn's trio worker runs each connection in the server's own
nursery, so an exception from its protocol code ended every connection and the
server. Hypercorn 0.18's HTTP/2 code raises `KeyError` for request data that arrives
on a stream it has already answered and closed (upstream's issue 329, the fix
unreleased): a gRPC health check's body sent a moment after the headers, or any
client that writes so on purpose, stopped `trio-mlx serve`. Such a failure is logged
as a warning, counted and rate-limited like refusals, and the connection closed.
Under `hypercorn -k trio trio_mlx.app:app` the app puts the same wrapper, with no cap,
around hypercorn's handler when its lifespan starts (`guard_hypercorn_trio`): hypercorn
binds the handler for its connections only after the lifespan's startup.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import trio

try:
    import resource
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]

log = logging.getLogger("trio_mlx.serve")

# Descriptors kept back from connections: model files, the actor's pipes, log files, the
# tokenizer's threads, a few hundred would do. Judgement.
RESERVE = 256
ACCEPT_LOGGER = "trio.serve_listeners"


def raise_soft_limit() -> tuple[int, int]:
    """Lift the soft open-file limit to the hard one; returns (soft, hard) as they are after."""
    if resource is None:  # pragma: no cover
        return (0, 0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft, hard


def connection_cap(configured: int) -> int:
    """The connection cap: `configured`, or when 0 the soft open-file limit (raised to the
    hard one) less RESERVE and a tenth, but at least 16."""
    soft, _ = raise_soft_limit()
    if configured:
        return configured
    return max(16, int((soft - RESERVE) * 0.9)) if soft else 1 << 20


def _refusal(retry_after: int) -> bytes:
    body = (b'{"error": {"message": "the server has too many open connections; retry shortly", '
            b'"type": "server_error", "param": null, "code": "too_many_connections"}}')
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"retry-after: %d\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % (retry_after, len(body)) + body)


class OneSender:
    """A connection's stream whose `send_all` calls wait for each other and whose `send_eof`
    never runs beside one: it refuses with `BusyResourceError` while a send is on its way,
    as trio's own `send_eof` does when it notices (hypercorn then closes the stream). The
    rest is the stream's own."""

    def __init__(self, stream: Any):
        self._stream = stream
        self._sending = trio.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        async with self._sending:
            await self._stream.send_all(data)

    async def send_eof(self) -> None:
        try:
            self._sending.acquire_nowait()
        except trio.WouldBlock:
            raise trio.BusyResourceError("another task is currently sending data on this stream") from None
        try:
            await self._stream.send_eof()
        finally:
            self._sending.release()


class Tally:
    """A count of events that are logged in one line at most every `every` seconds: `add`
    counts one and says how many to log now, all since the last line (0: not yet)."""

    def __init__(self, every: float, clock: Callable[[], float] = time.monotonic):
        self.total = 0
        self.every = every
        self._clock = clock
        self._logged_at = -math.inf
        self._unlogged = 0

    def add(self) -> int:
        self.total += 1
        self._unlogged += 1
        now = self._clock()
        if now - self._logged_at < self.every:
            return 0
        due, self._logged_at, self._unlogged = self._unlogged, now, 0
        return due


class ConnectionGate:
    """Counts hypercorn's connections; refuses those over `limit`."""

    def __init__(self, limit: int, *, log_every: float = 10.0):
        self.limit = limit
        self.open = 0
        self.refusals = Tally(log_every)
        self.failures = Tally(log_every)  # connections ended by an exception inside hypercorn (the module docstring)

    def wrap(self, handler: Callable[..., Any]) -> Callable[..., Any]:
        """`handler` (hypercorn's TCPServer class), counted and capped."""

        async def capped(app: Any, config: Any, context: Any, state: Any, stream: Any) -> None:
            if self.open >= self.limit:
                self._refuse()
                # Answer, then read what the client sent before closing: closing a socket with
                # unread data resets it, and the client may lose the answer. At most a second.
                with trio.move_on_after(1.0):
                    try:
                        await stream.send_all(_refusal(1))
                        if hasattr(stream, "send_eof"):
                            await stream.send_eof()
                        while await stream.receive_some(65536):
                            pass
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
                return  # trio.serve_listeners closes the stream
            self.open += 1
            try:
                await handler(app, config, context, state, OneSender(stream))
            except* Exception as group:  # cancellation and the like go on up
                self._fail(group)
            finally:
                self.open -= 1

        capped.trio_mlx_gate = self  # type: ignore[attr-defined]
        return capped

    def _fail(self, group: BaseExceptionGroup) -> None:
        if n := self.failures.add():
            first: BaseException = group
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            log.warning("%d connection(s) ended by an error inside the HTTP server (the last: %r); "
                        "closed, the server goes on", n, first)

    def _refuse(self) -> None:
        if n := self.refusals.add():
            log.warning("%d open connections, the cap (max_connections): refused %d new one(s) with 503",
                        self.open, n)


@contextmanager
def capped_connections(limit: int) -> Iterator[ConnectionGate]:
    """While inside, hypercorn's trio worker caps its connections at `limit`."""
    import hypercorn.trio.run as run

    gate = ConnectionGate(limit)
    original = run.TCPServer
    run.TCPServer = gate.wrap(original)  # type: ignore[assignment,misc]
    try:
        yield gate
    finally:
        run.TCPServer = original  # type: ignore[misc]


def guard_hypercorn_trio() -> ConnectionGate | None:
    """Under hypercorn's trio worker with no gate of `trio-mlx serve`'s (`capped_connections`):
    put one around its connection handler, with no cap (hypercorn's own settings hold), so
    that one connection's failure ends that connection alone (the module's docstring). It
    takes effect for the connections hypercorn accepts after the app's lifespan startup,
    which is all of them. None where hypercorn's trio worker is not loaded or a gate is on."""
    import sys

    run: Any = sys.modules.get("hypercorn.trio.run")
    if run is None or hasattr(run.TCPServer, "trio_mlx_gate"):
        return None
    gate = ConnectionGate(1 << 62)
    run.TCPServer = gate.wrap(run.TCPServer)
    return gate


class AcceptErrorFilter(logging.Filter):
    """Lets one accept-loop error through per `interval` seconds, without its traceback,
    saying how many were dropped since."""

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.interval = interval
        self._errors = Tally(interval, clock)

    def filter(self, record: logging.LogRecord) -> bool:
        if not (n := self._errors.add()):
            return False
        if dropped := n - 1:
            record.msg = f"{record.msg} ({dropped} more like it in the last {self.interval:g} s)"
        record.exc_info = None
        record.exc_text = None
        return True


def quiet_accept_errors() -> None:
    """Install the filter on trio's accept loop logger, once."""
    logger = logging.getLogger(ACCEPT_LOGGER)
    if not any(isinstance(f, AcceptErrorFilter) for f in logger.filters):
        logger.addFilter(AcceptErrorFilter())
