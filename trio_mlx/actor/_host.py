"""Several models' actors on the one GPU thread: `ActorHost`, for a server of several models.

MLX's state stays with one thread (docs/design.md, rule 1): the host is started once, with
`trio.to_thread.run_sync`, and every model's `Actor` lives on it, each with its own
`ThreadLink` to its own engine. A model's engine hands its actor to the host
(`ActorHost.serve`, the engine's actor factory for this mode) and waits there for its end.

The host runs its actors in turns: each turn hands one actor's last report over, takes its
commands and runs one step of that actor, and the next turn goes to the next actor with
work, round-robin, so a decode step serves one model's batch at a time and models with work
share the device step by step. With no actor at work it blocks until a command comes for
any of them (their links share one event), or until held arrivals are due. Loading a model
(`Actor.start`: weights, warm-up) runs on the host too, so the other models' steps pause
while it loads, as they do under mlx_lm.server; their requests wait, none fails. An actor
that stops (a Shutdown: its model is unloaded) frees its arrays here (`Actor.stop`, which
ends with `mx.clear_cache`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import trio

from ._link import ActorPort, ThreadLink
from ._protocol import ActorConfig, StepReport

log = logging.getLogger("trio_mlx.actor")

# How often the host checks, while every actor is idle, that it was not cancelled; as
# `_link._IDLE_CHECK`.
_IDLE_CHECK = 0.5


@dataclass(eq=False)
class _Hosted:
    """One model's actor on the host, and what the host knows of it."""

    actor: Any  # an `Actor` (or a stand-in with its hosted methods: start, due, turn, settle, stop)
    link: ThreadLink
    done: trio.Event = field(default_factory=trio.Event)
    report: StepReport | None = None  # its last step's report, not handed over yet
    started: bool = False
    leave: bool = False  # its engine's task was cancelled: free it, no clean stop
    error: BaseException | None = None


class ActorHost:
    """The one GPU thread of a server of several models. Start `run` in a nursery once; each
    engine then calls `serve` (its actor's whole life, as `trio.to_thread.run_sync(actor.run)`
    is for one model)."""

    def __init__(self, make_actor: Any = None, *, prompt_cache_share: float = 1.0):
        """`make_actor(config, link)`: the actor (`Actor` when None; tests pass stand-ins);
        `prompt_cache_share`: each actor's share of the default prompt cache bound
        (`ActorConfig.prompt_cache_share`), 1/N where N models may be loaded at once."""
        self._make = make_actor
        self._share = prompt_cache_share
        self._arrived = threading.Event()  # a command for any actor, or a new actor
        self._incoming: deque[_Hosted] = deque()  # filled on the trio thread, read on the host's
        self._hosted: list[_Hosted] = []  # the host thread's own
        self._next = 0  # where the next round-robin scan starts
        self._token: trio.lowlevel.TrioToken | None = None
        self._running = False
        self.thread_id: int | None = None

    # -- the trio side ---------------------------------------------------------

    async def run(self, *, limiter: trio.CapacityLimiter | None = None,
                  task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The host thread's whole life; returns when cancelled, once every actor is freed."""
        self._token = trio.lowlevel.current_trio_token()
        self._running = True
        task_status.started(self)
        try:
            await trio.to_thread.run_sync(self._main, limiter=limiter, abandon_on_cancel=False)
        finally:
            self._running = False
            while self._incoming:  # handed over as the thread ended: never started, nothing to free
                hosted = self._incoming.popleft()
                hosted.error = RuntimeError("the actor host stopped")
                hosted.done.set()

    async def serve(self, config: ActorConfig, port: ActorPort) -> None:
        """Run one model's actor on the host until it stops (a Shutdown) or dies (raises
        what it raised). Cancelled, the actor is freed on the host before this returns."""
        if not self._running:
            raise RuntimeError("the actor host is not running")
        link = ThreadLink(port, arrived=self._arrived)
        config = dataclasses.replace(config, prompt_cache_share=self._share)
        if self._make is None:
            from ._actor import Actor

            actor = Actor(config, link)
        else:
            actor = self._make(config, link)
        hosted = _Hosted(actor, link)
        self._incoming.append(hosted)
        self._arrived.set()
        try:
            await hosted.done.wait()
        finally:
            if not hosted.done.is_set():  # cancelled: the host frees it at its next turn
                hosted.leave = True
                self._arrived.set()
                with trio.CancelScope(shield=True):
                    await hosted.done.wait()
            link.release()
        if hosted.error is not None:
            raise hosted.error

    # -- the host thread -------------------------------------------------------

    def _main(self) -> None:
        from . import _streams as streams  # MLX on the host thread only

        self.thread_id = threading.get_ident()
        worked, released = time.perf_counter(), True
        streams.begin()
        try:
            while True:
                trio.from_thread.check_cancelled()
                self._arrived.clear()  # first: a command queued meanwhile sets it again
                while self._incoming:
                    self._start(self._incoming.popleft())
                now = time.perf_counter()
                hosted, wait = self._pick(now)
                if hosted is not None:
                    self._turn(hosted)
                    worked, released = now, False
                    continue
                if not released and (release := self._release_seconds()):
                    if now - worked >= release:  # idle a while: MLX's buffer cache goes back
                        _clear_cache()
                        released = True
                    else:
                        wait = min(wait, release - (now - worked))
                self._arrived.wait(wait)
        finally:
            try:
                for hosted in [*self._hosted, *self._incoming]:
                    self._end(hosted, None, clean=False)
                self._hosted.clear()
                self._incoming.clear()
            finally:
                streams.end()

    def _release_seconds(self) -> float:
        """How long every actor idles before MLX's buffer cache is handed back, as one actor's
        `_idle` does (the first actor's `idle_release`; without it, on a GPU only)."""
        if not self._hosted:
            return 0.0
        release = getattr(self._hosted[0].actor.config.tuning, "idle_release", None)
        if release is not None:
            return float(release)
        from ._memory import IDLE_RELEASE, on_gpu

        return IDLE_RELEASE if on_gpu() else 0.0

    def _start(self, hosted: _Hosted) -> None:
        """Load a model (its `Actor.start`: the other models' steps wait meanwhile)."""
        if hosted.leave:
            self._done(hosted)
            return
        self._hosted.append(hosted)
        t0 = time.perf_counter()
        try:
            hosted.started = True
            hosted.actor.start()
        except BaseException as exc:
            self._end(hosted, exc, clean=False)
            if not isinstance(exc, Exception):
                raise
            return
        log.info("actor host: a model joined in %.2f s (%d on the GPU thread)",
                 time.perf_counter() - t0, len(self._hosted))

    def _pick(self, now: float) -> tuple[_Hosted | None, float]:
        """The next actor with work, round-robin; or None and how long to wait for one."""
        hosted, n = self._hosted, len(self._hosted)
        wait = _IDLE_CHECK
        for i in range(n):
            h = hosted[(self._next + i) % n]
            if h.leave or h.report is not None or h.link.pending:
                self._next = (self._next + i + 1) % n
                return h, 0.0
            due = h.actor.due(now)
            if due is not None:
                if due <= 0:
                    self._next = (self._next + i + 1) % n
                    return h, 0.0
                wait = min(wait, due)
        return None, wait

    def _turn(self, hosted: _Hosted) -> None:
        """One turn of one actor: hand its report over, take its commands, run its step (or,
        with nothing to do, leave it until a command or its held arrivals are due)."""
        if hosted.leave:
            self._end(hosted, None, clean=False)
            return
        link, actor = hosted.link, hosted.actor
        try:
            if hosted.report is not None:
                report, hosted.report = hosted.report, None
                commands = link.exchange(report)
                if (settled := actor.settle(link)) is not None and not commands:
                    hosted.report = settled  # a dry batch's rows left: the idle figures, next turn
                    return
            else:
                commands = link.take()
            if not commands:
                due = actor.due(time.perf_counter())
                if due is None or due > 0:
                    link.built()  # no step to build: a report held for one goes over now
                    return
            report = actor.turn(commands)
        except BaseException as exc:
            self._end(hosted, exc, clean=False)
            if not isinstance(exc, Exception):
                raise
            return
        if report is None:  # Shutdown: its model is unloaded
            self._end(hosted, None, clean=True)
        else:
            hosted.report = report

    def _end(self, hosted: _Hosted, error: BaseException | None, *, clean: bool) -> None:
        """Free an actor's arrays here, on the host, and wake its `serve`."""
        if hosted in self._hosted:
            self._hosted.remove(hosted)
            self._next = 0
        try:
            if hosted.started:
                hosted.actor.stop(clean)
        except Exception as exc:
            error = error or exc
        finally:
            hosted.error = error
            self._done(hosted)

    def _done(self, hosted: _Hosted) -> None:
        if self._token is None:
            return
        try:
            self._token.run_sync_soon(hosted.done.set)
        except trio.RunFinishedError:
            pass


def _clear_cache() -> None:
    from ._memory import clear_cache

    clear_cache()
