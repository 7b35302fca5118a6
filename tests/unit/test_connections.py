"""File descriptors (server/_connections.py, trio_mlx/_fdlimit.py): the open-file limit is raised, not
lowered by mlx-lm; connections over the cap get a clear 503 at once; slow bodies are cut by the body
timeout; accept errors are logged once in a while, not ten times a second.

Here the pieces alone; the limit and the cap in real processes: tests/system/test_connections.py.
"""

from __future__ import annotations

import logging
import sys

import pytest
import trio
import trio.testing

from trio_mlx.server._connections import AcceptErrorFilter, ConnectionGate, OneSender

pytestmark = pytest.mark.timeout(90)


def test_hypercorn_still_calls_the_handler_the_cap_wraps() -> None:
    import hypercorn.trio.run as run

    assert "TCPServer" in run.worker_serve.__code__.co_names


class _Stream:
    """A socket stream's sending side as trio guards it: one sender at a time (a second one
    raises BusyResourceError); `send_eof` yields while it holds it (here until `gate`)."""

    socket = "the socket"

    def __init__(self) -> None:
        self.busy = False
        self.sent: list[bytes] = []
        self.gate = trio.Event()

    async def _hold(self, until: trio.Event | None) -> None:
        if self.busy:
            raise trio.BusyResourceError("another task is currently sending data on this SocketStream")
        self.busy = True
        try:
            if until is not None:
                await until.wait()
            else:
                await trio.lowlevel.checkpoint()
        finally:
            self.busy = False

    async def send_all(self, data: bytes) -> None:
        await self._hold(self.gate if data == b"blocked" else None)
        self.sent.append(data)

    async def send_eof(self) -> None:
        await self._hold(self.gate)


async def test_a_half_close_beside_a_send_no_longer_breaks_the_connection() -> None:
    """Hypercorn half-closes a stream (`send_eof`) outside the lock its sends take, and trio's
    `send_eof` yields holding the stream's sending side: a send that came then raised
    BusyResourceError and ended the server. Through `OneSender` the send waits its turn, and
    a half-close beside a send is refused as trio refuses it (hypercorn then closes)."""
    bare = _Stream()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bare.send_eof)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):  # what ended the server
            await bare.send_all(b"data")
        bare.gate.set()

    inner = _Stream()
    stream = OneSender(inner)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.send_eof)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(stream.send_all, b"data")
        await trio.testing.wait_all_tasks_blocked()
        assert inner.sent == []  # it waits for the half-close
        inner.gate.set()
    assert inner.sent == [b"data"]
    assert stream.socket == "the socket"  # the rest is the stream's own

    inner = _Stream()
    stream = OneSender(inner)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.send_all, b"blocked")  # a send the peer does not read
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await stream.send_eof()
        inner.gate.set()


async def test_a_connection_that_fails_inside_hypercorn_ends_alone(caplog: pytest.LogCaptureFixture) -> None:
    """Hypercorn's trio worker runs each connection in the server's nursery: an exception from
    its protocol code (HTTP/2 data on a stream it has closed raises KeyError) ended the
    server. Through the gate it ends that connection, counted and logged once per interval;
    cancellation still goes through."""

    async def broken(app: object, config: object, context: object, state: object, stream: object) -> None:
        async with trio.open_nursery() as inner:  # as hypercorn's connection task group raises it
            inner.start_soon(trio.sleep_forever)
            raise KeyError(1)

    gate = ConnectionGate(100, log_every=60.0)
    wrapped = gate.wrap(broken)
    with caplog.at_level(logging.WARNING, logger="trio_mlx.serve"):
        for _ in range(3):
            await wrapped(None, None, None, None, _Stream())
    assert gate.failures.total == 3 and gate.open == 0
    warned = [r.getMessage() for r in caplog.records if "ended by an error" in r.getMessage()]
    assert warned == ["1 connection(s) ended by an error inside the HTTP server (the last: KeyError(1)); "
                      "closed, the server goes on"]

    async def waits(app: object, config: object, context: object, state: object, stream: object) -> None:
        await trio.sleep_forever()

    with trio.move_on_after(0.05) as scope:
        await gate.wrap(waits)(None, None, None, None, _Stream())
    assert scope.cancelled_caught and gate.failures.total == 3 and gate.open == 0


def test_under_hypercorns_trio_worker_the_app_gates_its_connections_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`hypercorn -k trio trio_mlx.app:app` has no `trio-mlx serve` around it: the app's first
    call (the lifespan, before hypercorn binds its connection handler) puts the gate around
    hypercorn's handler, with no cap; once, and not over `trio-mlx serve`'s own."""
    import hypercorn.trio.run as run

    from trio_mlx.server._connections import capped_connections, guard_hypercorn_trio

    async def original(app: object, config: object, context: object, state: object, stream: object) -> None:
        pass  # hypercorn's handler (an app natively on trio earlier in this process gated the real one)

    monkeypatch.setattr(run, "TCPServer", original)
    gate = guard_hypercorn_trio()
    assert gate is not None and gate.limit > 1 << 40
    assert run.TCPServer is not original and run.TCPServer.trio_mlx_gate is gate  # type: ignore[attr-defined]
    assert guard_hypercorn_trio() is None  # once
    monkeypatch.setattr(run, "TCPServer", original)
    with capped_connections(30) as served:
        assert guard_hypercorn_trio() is None and run.TCPServer.trio_mlx_gate is served  # type: ignore[attr-defined]


def test_accept_errors_are_logged_once_per_interval() -> None:
    now = [0.0]
    flt = AcceptErrorFilter(interval=10.0, clock=lambda: now[0])

    def record() -> logging.LogRecord:
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            return logging.LogRecord("trio.serve_listeners", logging.ERROR, __file__, 1,
                                     "accept returned EMFILE; retrying", (), sys.exc_info())

    passed = []
    for i in range(100):  # ten seconds at trio's pace, 10 a second
        now[0] = i * 0.1
        r = record()
        if flt.filter(r):
            passed.append(r)
    now[0] = 10.05
    r = record()
    assert flt.filter(r)
    passed.append(r)
    assert len(passed) == 2 and all(r.exc_info is None for r in passed)
    assert "99 more like it" in passed[1].getMessage()
