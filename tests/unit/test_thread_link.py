"""ThreadLink (actor/_link.py): a decode step's report goes over once the actor has built its
next graph (only for an actor that says when it has built), and commands reach the actor as
they are queued."""

from __future__ import annotations

import threading
import time

import pytest
import trio
import trio.testing

from trio_mlx.actor import _link
from trio_mlx.actor._protocol import Abort, StepReport, TokenOut

REPORT = StepReport(tokens=(TokenOut(1, 5),))
PREFILL = StepReport(tokens=(TokenOut(2, 6),), prompt_tokens=12)
FIRST = StepReport(tokens=(TokenOut(3, 7),), first=True)  # first tokens read in the step that sampled them


class _Port:
    def __init__(self) -> None:
        self.on_command = None
        self.delivered = threading.Event()
        self.reports: list[StepReport] = []
        self.queued: list = []

    def ready(self, info) -> None:
        pass

    def deliver(self, report: StepReport) -> None:
        self.reports.append(report)
        self.delivered.set()

    def drain_commands(self) -> list:
        out, self.queued = self.queued, []
        return out


async def _while_building(link: _link.ThreadLink, port: _Port, arm: bool,
                          report: StepReport = REPORT) -> tuple[int, bool, bool]:
    """The event loop's ticks while the actor, after its exchange, builds its next graph for
    0.2 s; whether the report was taken in by then; and whether it was 1 s after `built`."""
    ticks = 0
    held = 0
    during = after = False

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    def actor() -> None:
        nonlocal held, during, after
        if arm:
            link.built()  # this actor says when it has built
        link.exchange(report)
        t0 = ticks
        time.sleep(0.2)  # building the next step's graph
        held = ticks - t0
        during = port.delivered.is_set()
        link.built()
        after = port.delivered.wait(1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.to_thread.run_sync(actor)
        nursery.cancel_scope.cancel()
    return held, during, after


@pytest.mark.parametrize("arm", [True, False])
async def test_a_decode_report_goes_over_once_the_next_graph_is_built(arm):
    """The loop is not woken to take a decode step's report in while the actor builds (it
    would take the GIL from the build), and never blocks meanwhile; the test stand-in, which
    never says it has built, hands its reports over at once."""
    port = _Port()
    held, during, after = await _while_building(_link.ThreadLink(port), port, arm)
    assert held > 10  # the loop ran its other tasks all along
    assert during is not arm and after
    assert port.reports == [REPORT]


@pytest.mark.parametrize("report", [PREFILL, FIRST], ids=["prefill", "first-tokens"])
async def test_a_report_with_first_tokens_goes_over_at_once(report):
    """A prefill step's report, and a step's whose first tokens the actor read at once (the
    step that ends a prompt processes no prompt tokens of mlx_lm's count): first tokens are a
    request's time to first token, never held for the next graph."""
    port = _Port()
    _, during, _ = await _while_building(_link.ThreadLink(port), port, True, report)
    assert during


async def test_a_held_report_goes_over_when_no_graph_follows():
    """A turn that builds nothing hands the held report over: with the next one, in order,
    at its exchange; before blocking for commands; and, once the actor's thread has ended,
    the engine takes it in (`release`)."""
    port = _Port()
    link = _link.ThreadLink(port)
    second = StepReport(tokens=(TokenOut(1, 7),))

    def actor() -> None:
        link.built()
        link.exchange(REPORT)  # held: a graph is expected
        link.exchange(second)  # none came (a failed step): both go over, in order
        link.exchange(REPORT)  # held again
        link.wait_commands(0.01)  # idle: goes over before the wait
        link.exchange(second)  # held, and the thread ends without a graph

    await trio.to_thread.run_sync(actor)
    await trio.testing.wait_all_tasks_blocked()
    assert port.reports == [REPORT, second, REPORT]
    link.release()
    assert port.reports == [REPORT, second, REPORT, second]


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
