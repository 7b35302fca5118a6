"""ThreadLink (actor/_link.py): the event loop waits while the actor builds a step's graph,
only for an actor that says when it has built, and commands reach the actor as they are queued."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from trio_mlx.actor import _link
from trio_mlx.actor._protocol import Abort, StepReport, TokenOut

REPORT = StepReport(tokens=(TokenOut(1, 5),))


class _Port:
    def __init__(self) -> None:
        self.on_command = None
        self.delivered = threading.Event()
        self.queued: list = []

    def ready(self, info) -> None:
        pass

    def deliver(self, report: StepReport) -> None:
        self.delivered.set()

    def drain_commands(self) -> list:
        out, self.queued = self.queued, []
        return out


async def _loop_runs_while(link: _link.ThreadLink, port: _Port, arm: bool) -> tuple[int, int]:
    """Ticks of an event-loop task while the actor, after its exchange, holds off `built`
    for 0.2 s, and after it calls `built`."""
    ticks = 0
    held = after = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    def actor() -> None:
        nonlocal held, after
        if arm:
            link.built()  # this actor says when it has built
        link.exchange(REPORT)
        port.delivered.wait(5)
        t0 = ticks
        time.sleep(0.2)  # building the next step's graph
        held = ticks - t0
        link.built()
        t1 = ticks
        time.sleep(0.05)
        after = ticks - t1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.to_thread.run_sync(actor)
        nursery.cancel_scope.cancel()
    return held, after


@pytest.mark.parametrize("arm", [True, False])
async def test_the_loop_waits_for_the_build_only_for_an_actor_that_reports_it(monkeypatch, arm):
    monkeypatch.setattr(_link, "_BUILD_WAIT", 5.0)
    port = _Port()
    held, after = await _loop_runs_while(_link.ThreadLink(port), port, arm)
    assert after > 0
    if arm:
        assert held <= 1  # blocked: at most the tick that was under way
    else:
        assert held > 10  # the test stand-in never says it has built: never waited for


async def test_commands_reach_the_actor_as_they_are_queued_without_an_exchange():
    port = _Port()
    link = _link.ThreadLink(port)
    assert port.on_command is not None

    def actor() -> list:
        return link.wait_commands(5)

    async with trio.open_nursery() as nursery:
        got: list = []

        async def run_actor() -> None:
            got.extend(await trio.to_thread.run_sync(actor))

        nursery.start_soon(run_actor)
        await trio.sleep(0.05)
        port.queued += [Abort(1), Abort(2)]  # two commands queued in one turn of the loop...
        port.on_command()
        port.on_command()
    assert got == [Abort(1), Abort(2)]  # ...reach the actor together, in order


async def test_a_command_queued_before_the_loop_takes_a_report_in_goes_with_that_take_in():
    """The actor's exchange waits for the loop to take its last report in, then takes its
    commands. A command queued before that take-in ran is taken with it, though the flush it
    scheduled for itself runs after (slow here): not a step later."""
    port = _Port()
    drain = port.drain_commands

    def slow_drain() -> list:
        time.sleep(0.1)
        return drain()

    port.drain_commands = slow_drain  # type: ignore[method-assign]
    link = _link.ThreadLink(port)
    scheduled = threading.Event()
    takes: list = []

    def actor() -> None:
        takes.append(link.exchange(REPORT))  # schedules the loop's take-in of REPORT
        scheduled.set()
        takes.append(link.exchange(REPORT))  # waits for that take-in, then takes its commands

    thread = threading.Thread(target=actor)
    thread.start()
    assert scheduled.wait(5)  # the loop held meanwhile (no checkpoint): the take-in waits for it
    port.queued.append(Abort(3))  # queued in the same turn of the loop, after the take-in
    port.on_command()
    await trio.to_thread.run_sync(thread.join, 5)
    assert takes == [[], [Abort(3)]]
