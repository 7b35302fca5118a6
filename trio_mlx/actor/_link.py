"""How the actor reaches the engine: the protocols, and the link across a thread.

The actor calls its link on its own thread, once per decode step
(`exchange`) or to block while idle (`wait_commands`); `ThreadLink` makes that
one synchronous `trio.from_thread` call into the engine (docs/design.md,
rule 2). The process actor's link is `_process.PipeLink`.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable
from typing import Protocol

import trio

from ._protocol import ActorInfo, Command, StepReport


class ActorPort(Protocol):
    """What the actor needs from the engine; every method runs on the trio thread."""

    def ready(self, info: ActorInfo) -> None: ...
    def exchange(self, report: StepReport) -> list[Command]: ...
    def wait_commands(self) -> Awaitable[list[Command]]: ...


class ActorLink(Protocol):
    """How the actor reaches the engine, called on the actor's thread: across a
    thread (ThreadLink) or a pipe (`_actor_process.PipeLink`)."""

    def ready(self, info: ActorInfo) -> None: ...
    def exchange(self, report: StepReport) -> list[Command]: ...
    def wait_commands(self, timeout: float | None = None) -> list[Command]:
        """Block until commands come (none after `timeout` seconds, if given)."""
        ...
    def check(self) -> None: ...


class ThreadLink:
    """The engine in this process: one synchronous `from_thread` call per step (rule 2)."""

    def __init__(self, port: ActorPort):
        self._port = port

    def ready(self, info: ActorInfo) -> None:
        trio.from_thread.run_sync(self._port.ready, info)

    def exchange(self, report: StepReport) -> list[Command]:
        return trio.from_thread.run_sync(self._port.exchange, report)

    def wait_commands(self, timeout: float | None = None) -> list[Command]:
        async def wait() -> list[Command]:
            with trio.move_on_after(math.inf if timeout is None else timeout):
                return await self._port.wait_commands()  # cancel-safe: a channel receive
            return []

        return trio.from_thread.run(wait)

    def check(self) -> None:
        trio.from_thread.check_cancelled()

