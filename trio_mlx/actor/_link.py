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


# How long the event loop waits, at most, for the actor to build a step's graph.
_BUILD_WAIT = 0.010
# How often an idle actor checks, while it waits for commands, that it was not cancelled.
_IDLE_CHECK = 0.5


class ThreadLink:
    """The engine in this process, across a thread. Each step the actor hands its report
    to the event loop, which takes it in between its tasks and then waits while the
    actor builds the next step's graph; commands reach the actor as the engine queues
    them, without a crossing of its own (docs/design.md, rules 2 and 7).

    The actor holds the GIL while it builds a step's graph (about a quarter of a decode
    step at 256 rows of a 1B model on a GPU) and releases it while MLX launches the kernels and waits for them. The tokens a
    report hands over wake the event loop's handlers at that very moment; with both
    threads runnable, CPython passes the GIL back and forth every switch interval, the
    build on the step's critical path stretches, and the loop's work would have fitted
    in the wait that follows. So after taking in a report with tokens (the actor steps
    next) the loop blocks, GIL released, until the actor says its graph is built
    (`built`, as the model's forward returns) or `_BUILD_WAIT` passes, and runs its
    handlers while the device computes. An actor that never calls `built` (the test
    stand-in) is never waited for.

    Nor does the actor wait for the loop to take a report in: only for the loop to have
    taken the one before, so the loop is never more than a step behind. Its commands
    come through `on_command`: when the engine queues one (on the trio thread), the
    link drains the engine's inbox into a deque the actor reads between steps, as the
    process actor reads its pipe, once the loop has run its current tasks (and as the
    loop takes a report in, before the actor may take its next commands).

    Each part was measured against one synchronous crossing per step, paired with the
    process actor: the wait for the build and the report a step ahead together close
    most of the thread actor's gap at high concurrency; the report a step ahead alone
    served what the synchronous crossing did (BENCHMARKS.md, "What the runtime does
    because of a measurement").
    """

    def __init__(self, port: ActorPort, *, arrived: threading.Event | None = None,
                 built: threading.Event | None = None):
        """`arrived` and `built`: events shared by the links of the actors one host thread runs
        (`_host.py`): a command for any of them wakes the host, and the loop waits for the
        host's next graph, whichever model's it is."""
        self._port = port
        self._token = trio.lowlevel.current_trio_token()
        self._built = built or threading.Event()
        self._waits = False  # set by the first `built`: this actor says when it has built
        self._taken = threading.Event()  # the loop has taken the last report in
        self._taken.set()
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
        self._taken.clear()
        self._built.clear()
        self._token.run_sync_soon(self._take_in, report)  # RunFinishedError once the loop is gone
        return self._take()

    def _take_in(self, report: StepReport) -> None:
        """On the trio thread, between its tasks: the report, the commands queued so far, then
        the wait for the build. The commands go before the actor may take its next ones: the
        flush a command scheduled for itself may run after this take-in, and the actor,
        woken by it, took its commands first and stepped once more without them (an abort
        was applied two steps after it was queued)."""
        try:
            self._port.deliver(report)
        except BaseException as exc:  # the actor raises it at its next exchange
            self._failure = exc
        self._flush()
        self._taken.set()
        if self._waits and report.tokens:
            self._built.wait(_BUILD_WAIT)

    def built(self) -> None:
        self._waits = True
        self._built.set()

    def wait_commands(self, timeout: float | None = None) -> list[Command]:
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
