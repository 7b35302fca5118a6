"""The streams' stall watchdog (`server/_pump.Pump.watch_stalls`): a client that takes no data
for stall_timeout seconds is cut; a pause of the server's own event loop is not the client's."""

from __future__ import annotations

import time
from types import SimpleNamespace

import trio

from trio_mlx.server._pump import Pump

STALL = 0.4


class _Sending:
    """A stream whose send is under way, as `_Stream._send_raw` marks one."""

    def __init__(self, pump: Pump):
        self.sending_since, self.paused_at = trio.current_time(), pump.paused
        self.rec = SimpleNamespace(request_id="req-test")
        self.streams: list[object] = []
        self.aborted: str | None = None
        self.cut = trio.Event()

    def abort(self, cause: str) -> None:
        self.aborted = cause
        self.cut.set()


async def test_a_pause_of_the_event_loop_is_not_the_clients_stall() -> None:
    """A send under way as the loop is held up past the timeout (a loaded host) is not cut
    for it: before, the watchdog's next tick found the send older than the timeout and cut a
    client that read promptly (the likely loss of a well-behaved request in the hostile
    soak on a loaded CI machine). A send that then waits on its client past the timeout, the loop running,
    still is."""
    pump = Pump(SimpleNamespace(settings=SimpleNamespace(stall_timeout=STALL, max_unread_tokens=0)))  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump.watch_stalls)
        await trio.sleep(0.05)
        stream = _Sending(pump)
        pump.streams.add(stream)  # type: ignore[arg-type]
        time.sleep(2.5 * STALL)  # noqa: ASYNC251 - the point: the event loop held up, the send under way
        await trio.sleep(STALL / 2)  # the watchdog's ticks after it
        assert stream.aborted is None
        with trio.fail_after(10):  # the loop runs; the send still waits on its client
            await stream.cut.wait()
        assert stream.aborted == "stall"
        nursery.cancel_scope.cancel()
