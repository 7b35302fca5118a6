"""A follower rank: its shard of the model, replaying rank 0's steps; no HTTP, no trio.

`trio-mlx serve MODEL --distributed tensor` on a rank other than 0 runs
`follower_main` on the process's main thread. It waits for rank 0's greeting
(the mode, the model's fingerprint, its ActorTuning), checks it holds the
same model, loads its shard through mlx-lm, warms up exactly as rank 0 does,
and then loops: one message from rank 0 per step (`_distributed.Channel`),
received a step ahead of the step it is for, its aborts and admitted submits
applied through `_distributed.apply_step` as rank 0 applies them (admission
replays rank 0's decision), and the same `BatchGenerator.next()`. Its tokens
are nobody's: rank 0 delivers the same ones. After a heartbeat (rank 0 is
idle) it waits for rank 0's wake-up on a socket (`_wake.py`) before it
receives the next message, rather than in MLX's collective, which polls.

A follower never decides to stop by itself: rank 0's "stop" (its SIGTERM
drain ended, or its actor left) ends it with status 0; Ctrl-C is ignored, as
in the process actor (rank 0 drains and then stops the group); a broken or
silent group ends it with status 1 (`_distributed.Watchdog`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from .. import models
from ._actor import Actor
from ._batch import batch_rows
from ._distributed import (
    BEAT,
    Channel,
    GroupRank,
    Replay,
    Watchdog,
    apply_step,
    fingerprint,
    init_group,
    load_shard,
    seed_all,
    state_of,
    token_digest,
)
from ._group import GroupError
from ._group_cache import open_group_cache
from ._protocol import ActorConfig, ActorInfo, Command, StepReport
from ._reuse import Reuse
from ._trace import StepTrace
from ._wake import WakeClient

log = logging.getLogger("trio_mlx.follower")


class _NoLink:
    """A follower talks to rank 0 through the group, never to an engine."""

    def ready(self, info: ActorInfo) -> None:
        pass

    def exchange(self, report: StepReport) -> list[Command]:
        raise GroupError("a follower has no engine")

    def wait_commands(self, timeout: float | None = None) -> list[Command]:
        raise GroupError("a follower has no engine")

    def check(self) -> None:
        pass

    def built(self) -> None:
        pass


class Follower(GroupRank):
    """A rank other than 0's part in its actor (`_rank.py`; the module docstring)."""

    logprobs = False  # rank 0 reports them; a follower's tokens are nobody's

    def __init__(self, *, group: Any, mode: str, channel: Channel, watchdog: Watchdog, timeout: float,
                 startup_timeout: float, cache_bytes: int = 0, wake: WakeClient | None = None):
        self._wake = wake  # None: idle, this rank waits inside the collective
        self._group, self._mode, self._channel, self._watch = group, mode, channel, watchdog
        self._timeout, self._startup = timeout, startup_timeout
        self._cache_bytes = cache_bytes  # rank 0's prompt cache bound
        self.number = group.rank()

    @contextlib.contextmanager
    def life(self) -> Iterator[None]:
        with self._failing():  # a failure before the loop (loading, warming up) fails the group too
            yield

    def load_weights(self) -> tuple[Any, dict[str, Any]]:
        with self._failing(), self._watch.guard("loading the shard", self._startup):
            model, config = load_shard(self.actor.config.model_path, self._mode, self._group)
            seed_all(self._channel, False, self._startup)
        return model, config

    def open_cache(self) -> Reuse:
        # Rank 0's bound; no pressure relief of its own: rank 0 decides it (`GroupCache`).
        return open_group_cache(self.actor._model, self._cache_bytes, None, leader=False)

    def loop(self) -> None:
        log.info("rank %d of %d (pid %d): following rank 0 (%s parallel, shard loaded)",
                 self.number, self._group.size(), os.getpid(), self._mode)
        path = self.actor.config.tuning.step_trace  # rank 0's, with this rank's number: its own trace
        trace = None
        if path:
            try:
                trace = StepTrace(f"{path}.rank{self.number}")
            except OSError as exc:  # rank 0's path need not exist on this rank's host
                log.warning("rank %d writes no step trace: %s", self.number, exc)
        try:
            with self._failing():  # at once: the actor's cleanup after it may wait on the broken group
                self._follow_steps(trace)
        finally:
            if trace is not None:
                trace.close()

    def _follow_steps(self, trace: StepTrace | None) -> None:
        """Rank 0's steps, one message each, pipelined as rank 0 sends them (`Leader`):
        the receive of the next message is queued on the stream before this step, and
        read once this step is built (by then it has come: the stream has run the step
        before), so this rank builds each step while its device runs the previous one."""
        actor = self.actor
        replay = actor._admission = Replay()  # type: ignore[assignment]
        channel, bound = self._channel, BEAT + self._timeout
        last_step = time.monotonic()
        digest = 0
        clock = time.perf_counter
        # This rank's state where rank 0 took the one the next message carries: before
        # applying the message held (none, at first).
        mine = state_of(actor, digest)
        t0 = clock()
        message = channel.recv(bound)
        while True:
            t1 = clock()
            kind = message[0] if isinstance(message, tuple) and message else None
            if kind == "stop":
                log.info("rank %d: rank 0 stopped the group", self.number)
                return
            if kind == "step":
                _, aborts, subs, state, evicted, marks = message
                if mine != state:
                    raise GroupError(f"rank {self.number} is out of step with rank 0: (steps, sequences, retired "
                                     f"rows, last tokens' digest, prompt cache counters) {mine} against {state}")
            elif kind != "beat":
                raise GroupError(f"a follower got an unknown message {message!r}")
            mine = state_of(actor, digest)
            if kind == "beat":
                release = actor._idle_release
                if release and not actor.schedule.seqs and time.monotonic() - last_step > release:
                    mx.clear_cache()  # idle as rank 0 is: hand the buffer cache back, once
                    last_step = float("inf")
                if self._wake is not None:  # rank 0 wakes this rank before its next message
                    self._wake.wait(bound)
            posted = channel.expect(bound)  # the next message, ahead of this step on the stream
            if kind == "step":
                with self._watch.guard("a decode step", self._timeout):
                    failed = apply_step(actor, replay, (aborts, subs, evicted, marks))
                    stepped = bool(actor.schedule.seqs)  # as rank 0 counts it
                    report = actor._step(failed)
                    if stepped:
                        digest = token_digest(report)
                        last_step = time.monotonic()
                if trace is not None:  # exchange_s: the wait for the message that led to this step
                    trace.write(t1, t1 - t0, report, actor._inserted, len(actor.schedule.retired),
                                batch_rows(actor._bg), actor._settled)
                    actor._settled = 0.0
            t0 = clock()
            message = channel.take(posted, bound)


def follower_main(model: str | None, *, cache_dir: str | None, backend: str, timeout: float,
                  startup_timeout: float) -> int:
    """Run this rank as a follower until rank 0 stops the group; the process's exit status.
    It joins the group here, on the thread that follows (`_distributed.init_group`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    try:
        group, backend = init_group(backend)
    except GroupError as exc:
        log.error("%s", exc)
        return 1
    watchdog = Watchdog(None, grace=0.0)
    channel = Channel(group, watchdog)
    rank = group.rank()
    wake: WakeClient | None = None
    try:
        message = channel.recv(startup_timeout, "waiting for rank 0 to start")
        if not (isinstance(message, tuple) and message[:1] == ("hello",)):
            raise GroupError(f"expected rank 0's greeting, got {message!r}")
        _, mode, leader_print, tuning, cache_bytes, wake_address = message
        problem = None
        try:
            path = models.resolve_model(model, cache_dir=cache_dir)
            if fingerprint(path) != leader_print:
                problem = (f"its model {str(path)!r} is not rank 0's (config.json {fingerprint(path)} "
                           f"against {leader_print}): start every rank with the same model")
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if channel.agree(problem is None, startup_timeout):
            if problem is not None:
                log.error("rank %d could not load the model: %s", rank, problem)
            else:
                log.error("rank %d: another rank could not load the model", rank)
            return 1
        wake = WakeClient.connect(wake_address, startup_timeout)  # connected before it is counted
        channel.count(wake is not None, startup_timeout, "counting the followers rank 0 can wake")
        config = ActorConfig(model_path=path, tuning=tuning)
        follower = Follower(group=group, mode=mode, channel=channel, watchdog=watchdog, timeout=timeout,
                            startup_timeout=startup_timeout, cache_bytes=cache_bytes, wake=wake)
        Actor(config, _NoLink(), follower).run()
    except GroupError as exc:
        log.error("rank %d: the group failed: %s", rank, exc)
        return 1
    except Exception:
        log.exception("rank %d failed", rank)
        return 1
    finally:
        watchdog.stop()
        if wake is not None:
            wake.close()
    return 0
