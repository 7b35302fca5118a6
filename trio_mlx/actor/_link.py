"""How the actor reaches the engine: the protocols, and the link across a thread.

The actor calls its link on its own thread, once per decode step
(`exchange`) or to block while idle (`wait_commands`); `ThreadLink` hands each
step's report to the event loop, which takes it in between its tasks, and
takes the engine's commands as they are queued (docs/design.md, rule 2). The
process actor's link is `_process.PipeLink`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import trio

from ._protocol import ActorInfo, Command, StepReport


class ActorPort(Protocol):
    """What the actor's link needs from the engine; every method runs on the trio thread."""

    on_command: Callable[[], None] | None  # called after each command queued for the actor

    def ready(self, info: ActorInfo) -> None: ...
    def deliver(self, report: StepReport) -> None: ...
    def drain_commands(self) -> list[Command]: ...


class ActorLink(Protocol):
    """How the actor reaches the engine, called on the actor's thread: across a
    thread (`ThreadLink`) or a pipe (`_process.PipeLink`)."""

    def ready(self, info: ActorInfo) -> None: ...
    def exchange(self, report: StepReport) -> list[Command]: ...
    def wait_commands(self, timeout: float | None = None) -> list[Command]:
        """Block until commands come (none after `timeout` seconds, if given)."""
        ...
    def check(self) -> None: ...
    def built(self) -> None:
        """The step's graph is built (called as the model's forward returns): from here to
        the step's end the actor waits for the device with the GIL released."""
        ...


# How often an idle actor checks, while it waits for commands, that it was not cancelled.
_IDLE_CHECK = 0.5


class ThreadLink:
    """The engine in this process, across a thread. Each step the actor hands its report
    to the event loop, which takes it in between its tasks, once the actor has built its
    next step's graph; commands reach the actor as the engine queues them, without a
    crossing of its own (docs/design.md, rules 2 and 7).

    The actor holds the GIL while it builds a step's graph (about a quarter of a decode
    step at 256 rows of a 1B model on a GPU) and releases it while MLX launches the
    kernels and waits for them. A report handed over wakes the event loop, which takes
    the GIL to take it in, and the tokens it delivers wake the loop's handlers; with
    both threads runnable, CPython passes the GIL back and forth every switch interval,
    and the build on the step's critical path stretches. So a decode step's report
    (tokens, no prompt tokens) from an actor that says when it has built (`built`, as the
    model's forward returns) is held at `exchange` and handed over by the next `built`:
    the loop wakes, takes it in and runs its handlers while the device computes. A turn
    that builds no graph (the actor idle, stopping or failing) hands it over at its next
    `exchange` or `wait_commands`, or the engine takes it in once the actor's thread has
    ended (`release`). A prefill step's report goes at once, as does one with first tokens
    read in the step that sampled them (`StepReport.first`): they are a request's time to
    first token, which would wait for the next step's graph. An actor that never calls
    `built` (the test stand-in) hands every report over at once.

    Nor does the actor wait for the loop to take a report in: only for the loop to have
    taken the one before, so the loop is never more than a step (and a graph) behind.
    Its commands come through `on_command`: when the engine queues one (on the trio
    thread), the link drains the engine's inbox into a deque the actor reads between
    steps, as the process actor reads its pipe, once the loop has run its current tasks
    (and as the loop takes a report in, before the actor may take its next commands).

    Measured against one synchronous crossing per step, paired with the process actor
    (BENCHMARKS.md, "What the runtime does because of a measurement"): keeping the loop
    out of the build and handing the report over a step ahead together closed most of
    the thread actor's gap at high concurrency. The loop first took a report in at once
    and then blocked until `built`; handing it over at `built` instead took the actor's
    exchange from ~110 to ~10 us a step, with a stand-in actor that holds the GIL
    0.95 ms a step (`benchmarks/probes/probe_gil_actor.py`).
    """

    def __init__(self, port: ActorPort, *, arrived: threading.Event | None = None):
        """`arrived`: an event shared by the links of the actors one host thread runs
        (`_host.py`): a command for any of them wakes the host."""
        self._port = port
        self._token = trio.lowlevel.current_trio_token()
        self._waits = False  # set by the first `built`: this actor says when it has built
        self._taken = threading.Event()  # the loop has taken the last report in
        self._taken.set()
        self._held: StepReport | None = None  # a decode step's report, for the next `built`
        self._failure: BaseException | None = None  # what the engine raised taking it in
        self._commands: deque[Command] = deque()  # filled on the trio thread, read on the actor's
        self._arrived = arrived or threading.Event()
        port.on_command = self._on_command

    def _on_command(self) -> None:
        """On the trio thread, as the engine queues a command: hand over, once the loop's
        current tasks have run, whatever they queued (arrivals of one moment enter together)."""
        self._token.run_sync_soon(self._flush, idempotent=True)  # one flush for the lot

    def _flush(self) -> None:
        if commands := self._port.drain_commands():  # (every take-in flushes: most find none)
            self._commands.extend(commands)
            self._arrived.set()

    @property
    def pending(self) -> bool:
        """Whether commands wait to be taken (a host's test, on the actor's thread)."""
        return bool(self._commands)

    def take(self) -> list[Command]:
        """The commands that wait, without a report to hand over (a host's idle actor)."""
        return self._take()

    def _take(self) -> list[Command]:
        self._arrived.clear()  # first: a command queued meanwhile sets it again
        out = []
        while self._commands:
            out.append(self._commands.popleft())
        return out

    def ready(self, info: ActorInfo) -> None:
        trio.from_thread.run_sync(self._port.ready, info)

    def exchange(self, report: StepReport) -> list[Command]:
        self._taken.wait()
        if self._failure is not None:
            raise self._failure
        held, self._held = self._held, None
        if held is not None:  # the turn since built no graph: both go over now, in order
            self._hand_over((held, report))
        elif self._waits and report.tokens and not report.prompt_tokens and not report.first:
            self._held = report
        else:
            self._hand_over((report,))
        return self._take()

    def built(self) -> None:
        self._waits = True
        self._hand_over_held()

    def _hand_over_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._hand_over((held,))

    def _hand_over(self, reports: tuple[StepReport, ...]) -> None:
        self._taken.clear()  # until this take-in: the next exchange waits for it
        self._token.run_sync_soon(self._take_in, reports)  # RunFinishedError once the loop is gone

    def _take_in(self, reports: tuple[StepReport, ...]) -> None:
        """On the trio thread, between its tasks: the reports, then the commands queued so far.
        The commands go before the actor may take its next ones: the flush a command
        scheduled for itself may run after this take-in, and the actor, woken by it, took its
        commands first and stepped once more without them (an abort was applied two steps
        after it was queued)."""
        for report in reports:
            try:
                self._port.deliver(report)
            except BaseException as exc:  # the actor raises it at its next exchange
                self._failure = exc
        self._flush()
        self._taken.set()

    def release(self) -> None:
        """On the trio thread, once the actor's thread has ended (it stopped, or died): take
        in the report it held for a graph it never built, if any."""
        held, self._held = self._held, None
        if held is not None:
            self._take_in((held,))

    def wait_commands(self, timeout: float | None = None) -> list[Command]:
        self._hand_over_held()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (commands := self._take()):
            left = _IDLE_CHECK if deadline is None else min(_IDLE_CHECK, deadline - time.monotonic())
            if left <= 0:
                break
            self._arrived.wait(left)
            self.check()
        return commands

    def check(self) -> None:
        trio.from_thread.check_cancelled()
