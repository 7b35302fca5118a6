"""The requests in flight and the exchange with the actor: `Registry`.

The registry numbers each request, gives it a channel of `max_tokens + 2` items (so
the actor's delivery never blocks: docs/design.md, rule 3), tracks its stage
(queued, prefill, decode) and ends it. It keeps the inbox of commands for the actor
(`Submit`, `Abort`, `Shutdown`), takes in each step's `StepReport` (`deliver`) and
keeps the counters `Engine.statistics()` reports. Everything here runs on the trio
thread; no locks, no awaits but `wait_commands`.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any

import trio

from .._errors import QueueFullError
from ..actor import Abort, Command, Grammar, SamplingParams, Shutdown, StepReport, Submit

# EngineStatistics' names for the actor's prompt cache figures (StepReport.prompt_cache), in order.
PROMPT_CACHE_FIELDS = ("prompt_cache_lookups", "prompt_cache_hits", "prompt_cache_hit_tokens",
                       "prompt_cache_evictions", "prompt_cache_bytes", "prompt_cache_entries")


@dataclass(frozen=True, slots=True)
class Terminal:
    """Put into a request's channel by the engine itself (failure, shutdown)."""

    finish_reason: str
    error: str | None


@dataclass(eq=False)
class Request:
    rid: int
    send: trio.MemorySendChannel[Any]
    recv: trio.MemoryReceiveChannel[Any]
    stage: str = "queued"
    ended: trio.Event = field(default_factory=trio.Event)  # set when the engine is done with it
    cached: int = 0  # prompt tokens the actor took from its prompt cache
    drafted: int = 0  # speculative decoding: tokens drafted for it
    accepted: int = 0  # ... and kept in its output
    prompt_tokens: int = 0


@dataclass
class Counters:
    submitted: int = 0
    finished: int = 0
    rejected: int = 0
    steps: int = 0
    generated: int = 0
    prompt_tokens: int = 0
    step_seconds_total: float = 0.0
    last_step_seconds: float = 0.0
    aborts: int = 0
    aborts_by_stage: collections.Counter[str] = field(default_factory=collections.Counter)
    aborts_by_cause: collections.Counter[str] = field(default_factory=collections.Counter)
    step_failures: int = 0
    restarts: int = 0
    drafted: int = 0
    accepted: int = 0


class Registry:
    """The engine's requests by id, their stages, the actor's inbox and the counters."""

    def __init__(self) -> None:
        self.requests: dict[int, Request] = {}
        self.stage_counts: collections.Counter[str] = collections.Counter()
        self._next_rid = 0
        self.live = 0  # sequences the actor holds, as its last report said
        self.c = Counters()
        self.last_progress: float | None = None
        self.memory: tuple[int, int, int] = (0, 0, 0)  # MLX (active, peak, cache) bytes, as the actor reads them
        self.memory_read_at = -math.inf  # trio time of that reading
        self.prompt_cache: tuple[int, ...] = (0, 0, 0, 0, 0, 0)  # the actor's prompt cache figures
        self.prompt_tokens_in_flight = 0  # the prompts' tokens of `requests`
        self._inbox_send: trio.MemorySendChannel[Command] | None = None
        self._inbox_recv: trio.MemoryReceiveChannel[Command] | None = None
        # Called on the trio thread after each command queued for the actor: a thread actor's
        # link takes commands as they come (`actor._link.ThreadLink`); None otherwise.
        self.on_command: Any = None
        self.idle = trio.Event()  # set when the last request ends

    # -- the inbox -------------------------------------------------------------

    def open_inbox(self) -> None:
        """A fresh inbox: at start, and at a restart, where the dead actor's commands go with it."""
        self._inbox_send, self._inbox_recv = trio.open_memory_channel(math.inf)

    def close_inbox(self) -> None:
        if self._inbox_send is not None:
            self._inbox_send.close()

    def to_actor(self, command: Command) -> None:
        """Queue a command for the actor, and tell its link (`on_command`) if it listens."""
        if self._inbox_send is None:
            return
        self._inbox_send.send_nowait(command)
        if self.on_command is not None:
            self.on_command()

    async def wait_commands(self) -> list[Command]:
        assert self._inbox_recv is not None
        try:
            first = await self._inbox_recv.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return [Shutdown()]
        return [first, *self.drain_commands()]

    def drain_commands(self) -> list[Command]:
        """The commands queued for the actor, taken out of the inbox (a Shutdown once it is closed)."""
        assert self._inbox_recv is not None
        out: list[Command] = []
        while True:
            try:
                out.append(self._inbox_recv.receive_nowait())
            except trio.WouldBlock:
                return out
            except (trio.EndOfChannel, trio.ClosedResourceError):
                out.append(Shutdown())
                return out

    # -- the actor's reports ---------------------------------------------------

    def deliver(self, report: StepReport) -> None:
        """Hand one step's tokens to their requests; update stages and counters."""
        now = trio.current_time()
        self.last_progress = now
        c = self.c
        if report.tokens:
            c.steps += 1
            c.generated += len(report.tokens)
            c.step_seconds_total += report.step_seconds
            c.last_step_seconds = report.step_seconds
        c.prompt_tokens += report.prompt_tokens
        self.live = report.live
        if report.memory is not None:
            self.memory, self.memory_read_at = report.memory, now
        if report.prompt_cache is not None:
            self.prompt_cache = report.prompt_cache
        requests = self.requests
        for rid, n in report.cached:
            if (req := requests.get(rid)) is not None:
                req.cached = n
        for rid, drafted, kept in report.speculated:  # before the tokens: a last token ends its request
            c.drafted += drafted
            c.accepted += kept
            if (req := requests.get(rid)) is not None:
                req.drafted += drafted
                req.accepted += kept
        for rid in report.prefilling:
            if (req := requests.get(rid)) is not None:
                self._set_stage(req, "prefill")
        for rid in report.decoding:
            if (req := requests.get(rid)) is not None:
                self._set_stage(req, "decode")
        for tok in report.tokens:
            req = requests.get(tok.rid)
            if req is None:
                continue  # aborted; the actor learns at this exchange
            try:
                req.send.send_nowait(tok)
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                self.abort(req, "gone")  # the reader is gone (rule 3)
                continue
            if tok.finish_reason is not None:
                self._finish(req)
        for rid, reason in report.failed:
            if (req := requests.get(rid)) is not None:
                c.step_failures += 1
                self._deliver_terminal(req, Terminal("error", reason))

    # -- requests --------------------------------------------------------------

    def submit(self, prompt: list[int], max_tokens: int, sampling: SamplingParams, stops: frozenset[int],
               grammar: Grammar | None, *, max_batch: int, max_queue: int, cache_salt: str = "",
               adapter: str | None = None) -> Request:
        """Register a request and queue its `Submit`, unless more than `max_queue` would wait
        beyond the batch's free slots (`QueueFullError`)."""
        sc = self.stage_counts
        free_slots = max(0, max_batch - sc["prefill"] - sc["decode"])
        if sc["queued"] - free_slots >= max_queue:  # waiting beyond the batch's free slots
            self.c.rejected += 1
            raise QueueFullError(f"too many requests are waiting ({max_queue}); retry shortly",
                                 retry_after=max(1.0, self.mean_step_seconds * max_tokens / 4))
        if not self.requests and not self.live:
            # The watchdog counts from the first work after idle, not from the last step before it.
            self.last_progress = trio.current_time()
        rid = self._next_rid = self._next_rid + 1
        send, recv = trio.open_memory_channel[Any](max_tokens + 2)
        req = Request(rid, send, recv, prompt_tokens=len(prompt))
        self.requests[rid] = req
        self.prompt_tokens_in_flight += req.prompt_tokens
        self.stage_counts["queued"] += 1
        self.idle = trio.Event() if self.idle.is_set() else self.idle
        self.c.submitted += 1
        assert self._inbox_send is not None
        self.to_actor(Submit(rid, tuple(prompt), max_tokens, sampling, stops, grammar, cache_salt, adapter))
        return req

    def abort(self, req: Request, cause: str) -> None:
        """Forget a request whose reader left; the actor drops its sequence at the next step."""
        if req.rid not in self.requests:
            return
        self._drop_sequence(req, cause)
        self._finish(req)

    def fail_all(self, term: Terminal) -> None:
        """End every request with `term`; on shutdown ("abort") also drop their sequences."""
        for req in list(self.requests.values()):
            if term.finish_reason == "abort":
                self._drop_sequence(req, "shutdown")
            self._deliver_terminal(req, term)

    def _set_stage(self, req: Request, stage: str) -> None:
        self.stage_counts[req.stage] -= 1
        self.stage_counts[stage] += 1
        req.stage = stage

    def _finish(self, req: Request) -> None:
        if self.requests.pop(req.rid, None) is None:
            return
        self.stage_counts[req.stage] -= 1
        self.prompt_tokens_in_flight -= req.prompt_tokens
        self.c.finished += 1
        req.send.close()
        req.ended.set()
        if not self.requests:
            self.idle.set()

    def _deliver_terminal(self, req: Request, term: Terminal) -> None:
        try:
            req.send.send_nowait(term)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        self._finish(req)

    def _drop_sequence(self, req: Request, cause: str) -> None:
        """Count an abort by stage and cause and tell the actor (sync, non-blocking)."""
        self.c.aborts += 1
        self.c.aborts_by_stage[req.stage] += 1
        self.c.aborts_by_cause[cause] += 1
        try:
            self.to_actor(Abort(req.rid))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    # -- figures ---------------------------------------------------------------

    @property
    def mean_step_seconds(self) -> float:
        return self.c.step_seconds_total / self.c.steps if self.c.steps else 0.0

    def figures(self) -> dict[str, Any]:
        """The registry's part of `EngineStatistics`, by its field names."""
        sc, c = self.stage_counts, self.c
        since = None
        if self.last_progress is not None and (self.requests or self.live):
            since = trio.current_time() - self.last_progress
        return dict(
            queued=sc["queued"],
            prefilling=sc["prefill"],
            decoding=sc["decode"],
            active=self.live,
            requests_submitted=c.submitted,
            requests_finished=c.finished,
            requests_rejected=c.rejected,
            decode_steps=c.steps,
            generated_tokens=c.generated,
            prompt_tokens=c.prompt_tokens,
            last_step_seconds=c.last_step_seconds,
            mean_step_seconds=self.mean_step_seconds,
            aborts=c.aborts,
            aborts_by_stage=dict(c.aborts_by_stage),
            aborts_by_cause=dict(c.aborts_by_cause),
            active_memory_bytes=self.memory[0],
            peak_memory_bytes=self.memory[1],
            cache_memory_bytes=self.memory[2],
            memory_read_at=self.memory_read_at,
            step_failures=c.step_failures,
            actor_restarts=c.restarts,
            seconds_since_step=since,
            draft_tokens=c.drafted,
            accepted_draft_tokens=c.accepted,
            **dict(zip(PROMPT_CACHE_FIELDS, self.prompt_cache, strict=True)),
            prompt_tokens_in_flight=self.prompt_tokens_in_flight,
        )
