"""The trio-side engine: admission, the request registry and per-request event streams.

`open_engine()` starts the GPU actor (one thread for the engine's whole life,
see `actor/_actor.py`, or a child process: `actor/_process.py`) and yields an
`Engine`. `engine.generate()` / `engine.chat()`
return `RequestStream`s: async context managers that tokenize and validate on
entry, then iterate `TextDelta` events and one terminal `Finished`. Leaving
the `async with` early, for any reason, sends an abort the actor applies
before its next decode step.

All registry state lives on the trio thread; the actor's link reaches it there
(`deliver()` with each step's report, `drain_commands()` for what the actor is
to apply), never from the actor's thread; no locks.
"""

from __future__ import annotations

import collections
import ctypes
import importlib
import logging
import math
import os
import pathlib
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from trio.lowlevel import RunVar

from .. import _heap as heap
from .._errors import (
    ContextLengthExceededError,
    EngineBrokenError,
    EngineClosedError,
    EngineRestartingError,
    InvalidRequestError,
    ModelLoadError,
    QueueFullError,
)
from ..actor import (
    Abort,
    ActorConfig,
    ActorInfo,
    ActorLink,
    Command,
    Grammar,
    SamplingParams,
    Shutdown,
    StepReport,
    Submit,
    TokenOut,
)
from ._events import (
    EngineStatistics,
    Event,
    Finished,
    TextDelta,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    ToolCalls,
    Usage,
)
from ._prompt import ChatEncoder, max_token_chars, prompt_chars
from ._structure import NO_STRUCTURE, Structure, check_structure, compile_structure
from ._supervise import RestartBudget
from ._text import HeldLogprobs, StopMatcher, keep_leading_space, normalize_messages

log = logging.getLogger("trio_mlx.engine")

# One GPU, one actor: every engine in a process shares this limiter (rule 1).
_GPU_LIMITER: RunVar[trio.CapacityLimiter] = RunVar("trio_mlx_gpu_limiter")
_TOKENIZER_LIMITER: RunVar[trio.CapacityLimiter] = RunVar("trio_mlx_tokenizer_limiter")
_BIG_TOKENIZER_LIMITER: RunVar[trio.CapacityLimiter] = RunVar("trio_mlx_big_tokenizer_limiter")
# Prompts longer than this many characters are tokenized in a worker thread so
# the event loop keeps serving; shorter ones cost less than the thread hop.
# The number is a judgement call, not a measurement.
_THREAD_TOKENIZE_CHARS = 4096
# For those two choices a chat message counts this many characters besides its text: its
# template costs about that much tokenizing (SmolLM2's template on the 2-core CPU box:
# 1,000 empty messages took 18 ms, 4,096 characters of text in one message 1.9 ms), so a
# request of many empty messages is not templated on the event loop.
_MESSAGE_CHARS = 40
# Prompts longer than this (a long document, not a chat turn) take a lane of their own, one at
# a time, so a few of them never keep ordinary long prompts waiting; at most
# _BIG_TOKENIZE_WAITING of them wait (more: 429). Judgement calls.
_BIG_TOKENIZE_CHARS = 256 * 1024
_BIG_TOKENIZE_WAITING = 8
# Seconds a new request may wait to join a decoding batch together with others
# (`actor/_admission.py` says why, and how the wait shrinks when few sequences
# decode); 20 ms is a few decode steps of a small model.
ADMIT_WINDOW = 0.02
# The most tokens an answer gets when its request names no max_tokens (0: up to the context's
# end, as OpenAI and vLLM do). A model that never writes its end-of-sequence token, or one
# looping on a question it cannot answer, would otherwise generate until the context is full:
# minutes on a large context, with nobody able to stop a non-streaming request. mlx_lm.server's
# default is 512; 4096 leaves room for a whole file's edit. Judgement.
DEFAULT_MAX_TOKENS = 4096
MAX_STOP_STRINGS = 16
# A stop string is a marker, not a document: the matcher compares the text it holds
# back with each one, so their lengths bound that work (16 stops of 1 MB made one
# step's check of held text take 0.8 s, on the event loop). Judgement.
MAX_STOP_CHARS = 1024
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MAX_TOP_LOGPROBS = 20


def gpu_limiter() -> trio.CapacityLimiter:
    try:
        return _GPU_LIMITER.get()
    except LookupError:
        _GPU_LIMITER.set(limiter := trio.CapacityLimiter(1))
        return limiter


def _big_tokenizer_limiter() -> trio.CapacityLimiter:
    try:
        return _BIG_TOKENIZER_LIMITER.get()
    except LookupError:
        _BIG_TOKENIZER_LIMITER.set(limiter := trio.CapacityLimiter(1))
        return limiter


def _tokenizer_limiter() -> trio.CapacityLimiter:
    try:
        return _TOKENIZER_LIMITER.get()
    except LookupError:
        _TOKENIZER_LIMITER.set(limiter := trio.CapacityLimiter(max(1, (os.cpu_count() or 2) // 2)))
        return limiter


@dataclass(frozen=True, slots=True)
class _Terminal:
    """Put into a request's channel by the engine itself (failure, shutdown)."""

    finish_reason: str
    error: str | None


@dataclass(eq=False)
class _Request:
    rid: int
    send: trio.MemorySendChannel[Any]
    recv: trio.MemoryReceiveChannel[Any]
    stage: str = "queued"
    ended: trio.Event = field(default_factory=trio.Event)  # set when the engine is done with it
    cached: int = 0  # prompt tokens the actor took from its prompt cache


@dataclass
class _Counters:
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


# EngineStatistics' names for the actor's prompt cache figures (StepReport.prompt_cache), in order.
_PROMPT_CACHE_FIELDS = ("prompt_cache_lookups", "prompt_cache_hits", "prompt_cache_hit_tokens",
                        "prompt_cache_evictions", "prompt_cache_bytes", "prompt_cache_entries")


class Engine:
    """One model, one GPU actor, many concurrent requests. Start with `open_engine()`
    or `await nursery.start(engine.run)`."""

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        max_batch: int = 64,
        prefill_batch: int = 8,
        prefill_step: int = 2048,
        prefill_budget: int | None = None,
        max_queue: int = 1024,
        cache_dir: os.PathLike[str] | None = None,
        warmup: bool = True,
        switch_interval: float | None = 0.0001,
        actor: str | Callable[[ActorConfig, ActorLink], Any] = "thread",
        admit_window: float = ADMIT_WINDOW,
        fault_hook: Any = None,
        retire_steps: int = 16,
        decode_step: str = "owned",
        idle_release: float | None = None,
        cache_limit_gb: float | None = None,
        step_trace: str | None = None,
        prompt_cache_gb: float | None = None,
        prompt_cache_disk_gb: float = 0.0,
        sampling_defaults: Mapping[str, Any] | None = None,
        restart_limit: int = 0,
        restart_window: float = 300.0,
        restart_backoff: float = 1.0,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
    ):
        if max_batch < 1 or prefill_batch < 1 or prefill_step < 1 or max_queue < 0:
            raise ValueError("max_batch, prefill_batch and prefill_step must be >= 1, max_queue >= 0")
        if prefill_budget is not None and (isinstance(prefill_budget, bool) or not isinstance(prefill_budget, int)
                                           or prefill_budget < 0):
            raise ValueError(f"prefill_budget must be an integer >= 0 or None, not {prefill_budget!r}")
        if not (math.isfinite(admit_window) and admit_window >= 0):
            raise ValueError(f"admit_window must be a finite number >= 0, not {admit_window!r}")
        if actor not in ("thread", "process") and not callable(actor):
            raise ValueError(f"actor must be 'thread', 'process' or an actor factory, not {actor!r}")
        if actor == "process" and fault_hook is not None:
            raise ValueError("fault_hook needs actor='thread'")
        self.actor_mode = actor
        self.model_ref = model
        self.max_batch = max_batch
        # mlx_lm's BatchGenerator widens its batch to the prefill batch when that is larger,
        # which would let more than max_batch sequences decode together.
        self.prefill_batch = min(prefill_batch, max_batch)
        self.prefill_step = prefill_step
        self.prefill_budget = prefill_budget  # None: the device's (`ActorConfig.prefill_budget`)
        self.max_queue = max_queue
        self.admit_window = admit_window
        self._cache_dir = cache_dir
        self._warmup = warmup
        self._switch_interval = switch_interval
        self._fault_hook = fault_hook
        if retire_steps < 0 or any(v is not None and not (math.isfinite(v) and v >= 0)
                                   for v in (idle_release, cache_limit_gb, prompt_cache_gb, prompt_cache_disk_gb)):
            raise ValueError("retire_steps, idle_release, prompt_cache_gb, prompt_cache_disk_gb and cache_limit_gb "
                             "must be >= 0")
        if decode_step not in ("owned", "mlx"):
            raise ValueError(f"decode_step must be 'owned' or 'mlx', not {decode_step!r}")
        self._prompt_cache_disk_gb = prompt_cache_disk_gb
        if isinstance(default_max_tokens, bool) or not isinstance(default_max_tokens, int) or default_max_tokens < 0:
            raise ValueError(f"default_max_tokens must be an integer >= 0, not {default_max_tokens!r}")
        self.default_max_tokens = default_max_tokens  # 0: up to the context's end
        # Actor knobs passed through as they are (`ActorConfig` documents each).
        self._actor_tuning: dict[str, Any] = dict(retire_steps=retire_steps, decode_step=decode_step,
                                  idle_release=idle_release,
                                  cache_limit_gb=cache_limit_gb, step_trace=step_trace,
                                  prompt_cache_gb=prompt_cache_gb)

        if sampling_defaults is not None:  # a bad default fails here, not in every request
            if unknown := set(sampling_defaults) - set(SAMPLING_DEFAULT_KEYS):
                raise ValueError(f"sampling_defaults takes {SAMPLING_DEFAULT_KEYS}, not {sorted(unknown)}")
            try:
                _validate(sampling_defaults, None)
            except InvalidRequestError as exc:
                raise ValueError(f"sampling_defaults: {exc}") from None
        self._sampling_override = sampling_defaults
        # What a request that leaves a sampling option out gets: the model's
        # generation_config.json (as vLLM does), unless `sampling_defaults` was given.
        self.sampling_defaults: dict[str, Any] = dict(sampling_defaults or {})

        self.state = "created"
        self.info: ActorInfo | None = None
        self.model_path: os.PathLike[str] | None = None
        self.tokenizer: Any = None
        self._chat: ChatEncoder | None = None
        self._max_token_chars = 0  # 0: no cheap size bound (engine/_prompt.py)
        self._big_waiting = 0
        self._special_ids: frozenset[int] = frozenset()
        self._eos_ids: frozenset[int] = frozenset()
        self._requests: dict[int, _Request] = {}
        self._stage_counts: collections.Counter[str] = collections.Counter()
        self._next_rid = 0
        self._live = 0
        self._c = _Counters()
        self._last_progress: float | None = None
        self._memory: tuple[int, int, int] = (0, 0, 0)  # MLX (active, peak, cache) bytes, as the actor reads them
        self._prompt_cache: tuple[int, ...] = (0, 0, 0, 0, 0, 0)  # the actor's prompt cache figures
        self._actor_error: BaseException | None = None
        self._inbox_send: trio.MemorySendChannel[Command] | None = None
        self._inbox_recv: trio.MemoryReceiveChannel[Command] | None = None
        # Called on the trio thread after each command queued for the actor: a thread actor's
        # link takes commands as they come (`actor._link.ThreadLink`); None otherwise.
        self.on_command: Callable[[], None] | None = None
        # A distributed group's status (`actor/_group.GroupStatus`) when this engine is rank 0
        # of one (`engine/_distributed.py`); None on a single device.
        self.group: Any = None
        self._ready_or_dead = trio.Event()
        self._actor_done = trio.Event()
        self._broken = trio.Event()
        self._stop_restarting = trio.Event()
        self._restarts = RestartBudget(restart_limit, restart_window, restart_backoff)
        self._idle = trio.Event()

    # -- lifecycle -------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model, start the actor, report started when warm; return when closed."""
        from .. import models  # imported here: loading MLX is the actor's business

        if self.state != "created":
            raise RuntimeError("an Engine can be run only once")
        self.state = "starting"
        try:
            # Each startup stage logs a line with its duration (the actor logs loading and warm-up).
            t0 = trio.current_time()
            log.info("resolving the model %s", self.model_ref or "(the embedded default)")
            path = await trio.to_thread.run_sync(
                lambda: models.resolve_model(self.model_ref, cache_dir=self._cache_dir)
            )
            self.model_path = path
            t1 = trio.current_time()
            log.info("resolved to %s in %.2f s; loading the tokenizer", path, t1 - t0)
            self.tokenizer = await trio.to_thread.run_sync(models.load_tokenizer, path)
            tok = self.tokenizer
            self._chat = await trio.to_thread.run_sync(lambda: ChatEncoder(tok).warm())
            # Every request's options are checked through the tools module (`_structure.py`),
            # which imports llguidance: 8-20 ms (thread or process actor) on the event loop for
            # the first request, unless imported here, in a worker thread.
            await trio.to_thread.run_sync(importlib.import_module, f"{__package__}._tools")
            log.info("tokenizer loaded in %.2f s", trio.current_time() - t1)
            if self._sampling_override is None:
                self.sampling_defaults = models.sampling_defaults(path)
        except BaseException:
            self.state = "closed"
            self._actor_done.set()
            raise
        self._max_token_chars = max_token_chars(self.tokenizer)
        self._special_ids = frozenset(getattr(self.tokenizer, "all_special_ids", ()) or ())
        self._eos_ids = frozenset(self.tokenizer.eos_token_ids or ())
        if self._switch_interval is not None:
            # The actor and the event loop share the GIL (docs/design.md, rule 7).
            sys.setswitchinterval(self._switch_interval)
        self._inbox_send, self._inbox_recv = trio.open_memory_channel(math.inf)

        config = ActorConfig(
            model_path=path,
            max_batch=self.max_batch,
            prefill_batch=self.prefill_batch,
            prefill_step=self.prefill_step,
            prefill_budget=self.prefill_budget,
            warmup=self._warmup,
            admit_window=self.admit_window,
            fault_hook=self._fault_hook,
            prompt_cache_disk=str(pathlib.Path(self._cache_dir or models.default_cache_dir()) / "prompt-cache")
            if self._prompt_cache_disk_gb else None,
            prompt_cache_disk_gb=self._prompt_cache_disk_gb,
            **self._actor_tuning,
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._run_actor, config)
            await self._ready_or_dead.wait()
            if self.state == "ready":
                task_status.started(self)
        # Only a failed start gets here before close: raise outside the nursery
        # so the error is not wrapped in an exception group.
        error = self._actor_error
        if self.info is None and error is not None:
            if isinstance(error, ModelLoadError):
                raise error
            raise ModelLoadError(
                f"could not load model {str(self.model_ref or 'default')!r} from {path}: "
                f"{type(error).__name__}: {error}"
            ) from error

    async def _run_one_actor(self, config: Any) -> None:
        """One actor's life: from starting it until it stops or dies."""
        if self.actor_mode == "process":
            from ..actor import run_actor_process

            await run_actor_process(config, ready=self.ready, deliver=self.deliver,
                                    wait_commands=self.wait_commands)
        else:
            from ..actor import Actor, ThreadLink

            factory: Any = Actor if self.actor_mode == "thread" else self.actor_mode
            actor = factory(config, ThreadLink(self))
            try:
                await trio.to_thread.run_sync(actor.run, limiter=gpu_limiter(), abandon_on_cancel=False)
            finally:
                self.on_command = None  # that link's actor is gone: a new one brings its own

    async def _run_actor(self, config: Any) -> None:
        """Run the actor; one that dies while serving is started again within the restart
        budget (`engine/_supervise.py`), and past it the engine is broken."""
        try:
            while True:
                try:
                    await self._run_one_actor(config)
                    return  # it stopped: a shutdown
                except trio.Cancelled:
                    raise
                except BaseException as exc:
                    self._actor_error = exc
                    if not isinstance(exc, Exception):
                        raise
                    if self.state not in ("ready", "restarting"):
                        if self.state == "draining":
                            log.error("the GPU actor died while draining: %s: %s", type(exc).__name__, exc)
                        return  # a failed first start (run() raises it), or the end of a drain
                # Died while serving: every request in flight ends now (rule 8), then a restart.
                error = self._actor_error
                self._fail_all(_Terminal("error", "the GPU actor died"))
                delay = self._restarts.next_delay(trio.current_time())
                if delay is None:
                    log.error("the GPU actor died (%s: %s); %s", type(error).__name__, error,
                              "restarts are off: the engine is broken" if not self._restarts.limit else
                              f"{self._restarts.limit} restarts within {self._restarts.window:g} s already: "
                              "the engine is broken")
                    self.state = "broken"
                    return
                log.warning("the GPU actor died (%s: %s); starting a new one in %.1f s (restart %d)",
                            type(error).__name__, error, delay, self._c.restarts + 1,
                            exc_info=error if self.actor_mode != "process" else None)  # a child: no traceback
                self.state = "restarting"
                self._c.restarts += 1
                self._live, self._memory = 0, (0, 0, 0)  # the dead actor's; the new one reports its own
                # Commands for the dead actor (aborts of the requests just failed) go with it.
                self._inbox_send, self._inbox_recv = trio.open_memory_channel(math.inf)
                with trio.move_on_after(delay):
                    await self._stop_restarting.wait()
                if self.state != "restarting":
                    return  # aclose() came meanwhile
        except trio.Cancelled:
            # The engine's own task was cancelled (the server is going down):
            # the actor noticed, freed its state and returned. Not a death.
            self.state = "closed"
            raise
        finally:
            if self.state == "broken":
                self._broken.set()
            elif self.state != "closed":
                self.state = "closed"
            reason = "the engine closed" if self.state == "closed" else "the GPU actor died"
            self._fail_all(_Terminal("error" if self.state == "broken" else "abort", reason))
            if self._inbox_send is not None:
                self._inbox_send.close()
            self._ready_or_dead.set()
            self._actor_done.set()

    def fail(self, reason: str) -> None:
        """The actor can no longer serve though its thread has not returned (a distributed
        group lost a rank, and the actor waits in a collective that will never end): end
        every request with an error event and refuse new ones, as if the actor had died."""
        if self.state in ("closed", "broken"):
            return
        self._actor_error = RuntimeError(reason)
        self.state = "broken"
        self._fail_all(_Terminal("error", reason))
        self._ready_or_dead.set()

    @property
    def restart_budget(self) -> RestartBudget:
        return self._restarts

    @property
    def actor_error(self) -> BaseException | None:
        """Why the last actor died, if one did."""
        return self._actor_error

    async def wait_broken(self) -> None:
        """Return when the engine is broken: its actor died and no restart is left."""
        await self._broken.wait()

    async def aclose(self, *, drain_timeout: float = 0.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to `drain_timeout`
        seconds, end the rest with finish_reason "abort", stop the actor."""
        if self.state == "restarting":  # nothing in flight; stop the restart
            self.state = "draining"
            self._stop_restarting.set()
        elif self.state == "ready":
            self.state = "draining"
            if self._requests and drain_timeout > 0:
                with trio.move_on_after(drain_timeout):
                    await self._idle.wait()
            self._fail_all(_Terminal("abort", "the server is shutting down"))
            try:
                self._to_actor(Shutdown())
            except trio.ClosedResourceError:
                pass
        await self._actor_done.wait()

    # -- called by the actor, on the trio thread -------------------------------

    def ready(self, info: ActorInfo) -> None:
        if self.state == "starting":
            # Startup is over here too: with the process actor, this process froze nothing
            # yet (with the thread actor, the actor's freeze covered it, and this one is
            # cheap). Not at a restart: what requests hold then is not for good.
            heap.freeze()
        self.info = info
        if self.state in ("starting", "restarting"):  # not "draining": a restart that aclose() met
            if self.state == "restarting":
                log.info("the new GPU actor is ready (pid %s)", info.pid)
            self.state = "ready"
        self._last_progress = trio.current_time()
        self._ready_or_dead.set()

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

    def deliver(self, report: StepReport) -> None:
        """Hand one step's tokens to their requests; update stages and counters."""
        now = trio.current_time()
        self._last_progress = now
        c = self._c
        if report.tokens:
            c.steps += 1
            c.generated += len(report.tokens)
            c.step_seconds_total += report.step_seconds
            c.last_step_seconds = report.step_seconds
        c.prompt_tokens += report.prompt_tokens
        self._live = report.live
        if report.memory is not None:
            self._memory = report.memory
        if report.prompt_cache is not None:
            self._prompt_cache = report.prompt_cache
        requests = self._requests
        for rid, n in report.cached:
            if (req := requests.get(rid)) is not None:
                req.cached = n
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
                self._abort(req, "gone")  # the reader is gone (rule 3)
                continue
            if tok.finish_reason is not None:
                self._finish(req)
        for rid, reason in report.failed:
            if (req := requests.get(rid)) is not None:
                c.step_failures += 1
                self._deliver_terminal(req, _Terminal("error", reason))

    # -- registry --------------------------------------------------------------

    def _set_stage(self, req: _Request, stage: str) -> None:
        self._stage_counts[req.stage] -= 1
        self._stage_counts[stage] += 1
        req.stage = stage

    def _finish(self, req: _Request) -> None:
        if self._requests.pop(req.rid, None) is None:
            return
        self._stage_counts[req.stage] -= 1
        self._c.finished += 1
        req.send.close()
        req.ended.set()
        if not self._requests:
            self._idle.set()

    def _deliver_terminal(self, req: _Request, term: _Terminal) -> None:
        try:
            req.send.send_nowait(term)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        self._finish(req)

    def _abort(self, req: _Request, cause: str) -> None:
        """Forget a request whose reader left; the actor drops its sequence at the next step."""
        if req.rid not in self._requests:
            return
        self._drop_sequence(req, cause)
        self._finish(req)

    def _fail_all(self, term: _Terminal) -> None:
        """End every request with `term`; on shutdown ("abort") also drop their sequences."""
        for req in list(self._requests.values()):
            if term.finish_reason == "abort":
                self._drop_sequence(req, "shutdown")
            self._deliver_terminal(req, term)

    def _drop_sequence(self, req: _Request, cause: str) -> None:
        """Count an abort by stage and cause and tell the actor (sync, non-blocking)."""
        self._c.aborts += 1
        self._c.aborts_by_stage[req.stage] += 1
        self._c.aborts_by_cause[cause] += 1
        try:
            self._to_actor(Abort(req.rid))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    def _to_actor(self, command: Command) -> None:
        """Queue a command for the actor, and tell its link (`on_command`) if it listens."""
        if self._inbox_send is None:
            return
        self._inbox_send.send_nowait(command)
        if self.on_command is not None:
            self.on_command()

    def _check_open(self) -> None:
        if self.state == "ready":
            return
        if self.state == "broken":
            raise EngineBrokenError(f"the GPU actor died: {self._actor_error!r}")
        if self.state == "restarting":
            raise EngineRestartingError("the GPU actor is being restarted after a failure; retry shortly")
        if self.state in ("created", "starting"):
            raise EngineClosedError("the engine is not ready yet")
        raise EngineClosedError("the engine is shutting down" if self.state == "draining" else "the engine is closed")

    def _submit(self, prompt: list[int], max_tokens: int, sampling: SamplingParams, stops: frozenset[int],
                grammar: Grammar | None = None) -> _Request:
        self._check_open()
        sc = self._stage_counts
        free_slots = max(0, self.max_batch - sc["prefill"] - sc["decode"])
        if sc["queued"] - free_slots >= self.max_queue:  # waiting beyond the batch's free slots
            self._c.rejected += 1
            raise QueueFullError(
                f"too many requests are waiting ({self.max_queue}); retry shortly",
                retry_after=max(1.0, self.mean_step_seconds * max_tokens / 4),
            )
        if not self._requests and not self._live:
            # The watchdog counts from the first work after idle, not from the last step before it.
            self._last_progress = trio.current_time()
        rid = self._next_rid = self._next_rid + 1
        send, recv = trio.open_memory_channel[Any](max_tokens + 2)
        req = _Request(rid, send, recv)
        self._requests[rid] = req
        self._stage_counts["queued"] += 1
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._c.submitted += 1
        assert self._inbox_send is not None
        self._to_actor(Submit(rid, tuple(prompt), max_tokens, sampling, stops, grammar))
        return req

    # -- public API ------------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self.info.context_length if self.info else 0

    @property
    def mean_step_seconds(self) -> float:
        return self._c.step_seconds_total / self._c.steps if self._c.steps else 0.0

    def statistics(self) -> EngineStatistics:
        sc = self._stage_counts
        since = None
        if self._last_progress is not None and (self._requests or self._live):
            since = trio.current_time() - self._last_progress
        return EngineStatistics(
            state=self.state,  # type: ignore[arg-type]
            queued=sc["queued"],
            prefilling=sc["prefill"],
            decoding=sc["decode"],
            active=self._live,
            requests_submitted=self._c.submitted,
            requests_finished=self._c.finished,
            requests_rejected=self._c.rejected,
            decode_steps=self._c.steps,
            generated_tokens=self._c.generated,
            prompt_tokens=self._c.prompt_tokens,
            last_step_seconds=self._c.last_step_seconds,
            mean_step_seconds=self.mean_step_seconds,
            aborts=self._c.aborts,
            aborts_by_stage=dict(self._c.aborts_by_stage),
            aborts_by_cause=dict(self._c.aborts_by_cause),
            active_memory_bytes=self._memory[0],
            peak_memory_bytes=self._memory[1],
            cache_memory_bytes=self._memory[2],
            step_failures=self._c.step_failures,
            actor_restarts=self._c.restarts,
            seconds_since_step=since,
            **dict(zip(_PROMPT_CACHE_FIELDS, self._prompt_cache, strict=True)),
            tokenizer_prefix_hits=self._chat.prefix.hits if self._chat is not None else 0,
            tokenizer_prefix_tokens=self._chat.prefix.reused_tokens if self._chat is not None else 0,
        )

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        logprobs: bool = False,
        top_logprobs: int = 0,
        response_format: Mapping[str, Any] | None = None,
        fit_max_tokens: bool = False,
    ) -> RequestStream:
        """Stream a completion of `prompt` (text, or token ids). With no `max_tokens` the
        answer gets at most the engine's `default_max_tokens` (and never past the context);
        with `fit_max_tokens`, `max_tokens` is a ceiling: where it does not fit beside the
        prompt, the answer may run to the context's end instead of being refused
        (Anthropic's newer models do so; `RequestStream.clamped` says it happened). `response_format`
        (OpenAI's: {"type": "json_object"}, or {"type": "json_schema", "json_schema":
        {"schema": ..., "strict": ...}}) holds the output to it, token by token. A sampling
        option left out (None) takes the model's default (`sampling_defaults`), else no
        effect (temperature 1, top_p 1, top_k 0, min_p 0, repetition_penalty 1)."""
        opts = dict(locals())
        del opts["self"], opts["prompt"]
        return RequestStream(self, ("text", prompt, None), opts)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        response_format: Mapping[str, Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
        **options: Any,
    ) -> RequestStream:
        """Stream the assistant's reply to `messages` (the model's chat template applies).
        Takes the same keyword options as `generate()`, and tool calling in OpenAI's
        shapes: `tools` (functions, rendered through the template's `tools`),
        `tool_choice` ("auto", "none", "required" or {"type": "function", "function":
        {"name": ...}}; the last two are enforced by constrained decoding) and
        `parallel_tool_calls` (False: at most one call, where enforced). Calls come as
        `ToolCalls` events and the request ends with finish_reason "tool_calls";
        while a call is written, `ToolCallDelta`s stream its name and arguments
        (JSON call formats; docs/engine.md). With `continue_final_message` the last message,
        the assistant's, is continued rather than answered (a prefill, as vLLM's option of
        that name and Anthropic's trailing assistant turn): the reply holds only the
        continuation; it cannot be held to a grammar (response_format, tool_choice
        "required" or named), which would start mid-message."""
        if continue_final_message:
            chat_template_kwargs = {**(chat_template_kwargs or {}), "continue_final_message": True}
        if tools is not None or tool_choice is not None:
            options.update(tools=tools, tool_choice=tool_choice)
        if not parallel_tool_calls:
            options["parallel_tool_calls"] = False
        if response_format is not None:
            options["response_format"] = response_format
        return RequestStream(self, ("chat", messages, chat_template_kwargs), options)

    def _check_size_bound(self, kind: str, chars: int, max_tokens: Any) -> None:
        """Refuse a prompt that cannot fit before tokenizing it: a text of B bytes (`chars`,
        UTF-8) is at least B / (the longest token's bytes) tokens. Tokenizing 16 MB costs ~25 s
        of CPU and a gigabyte; this costs nothing."""
        if not chars or not self._max_token_chars or not self.context_length:
            return
        floor = -(-chars // self._max_token_chars)
        want = max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) else 1
        if floor + want > self.context_length:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {self.context_length} tokens; the prompt "
                f"has {chars} bytes of text, at least {floor} tokens, and {want} more were requested",
                param="messages" if kind == "chat" else "prompt",
                prompt_tokens=floor, context_length=self.context_length,
            )

    async def _tokenize_big(self, kind: str, value: Any, template_kwargs: Any) -> list[int]:
        """Very long prompts are tokenized in a lane of their own (one at a time, a few waiting),
        so that they never hold up the ordinary ones; memory goes back to the system after."""
        if self._big_waiting >= _BIG_TOKENIZE_WAITING:
            raise QueueFullError(f"too many very long prompts ({self._big_waiting}) are waiting to be "
                                 "tokenized; retry shortly", retry_after=5.0)

        def job() -> list[int]:
            try:
                return self.encode_prompt(kind, value, template_kwargs)
            finally:
                _trim_memory()

        self._big_waiting += 1
        try:
            return await trio.to_thread.run_sync(job, limiter=_big_tokenizer_limiter())
        finally:
            self._big_waiting -= 1

    def encode_prompt(self, kind: str, value: Any, template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Prompt -> token ids (synchronous; may be slow for long prompts)."""
        tok = self.tokenizer
        if kind == "chat":
            messages = normalize_messages(value)
            if (template_kwargs or {}).get("continue_final_message") and (
                    not messages or messages[-1].get("role") != "assistant"):
                raise InvalidRequestError("continue_final_message needs the last message to be the "
                                          "assistant's, to continue", param="messages")
            if any(m.get("tool_calls") for m in messages):
                from ._tools import template_messages  # llguidance loads with it: only when needed

                messages = template_messages(messages)
            if self._chat is None or self._chat.tokenizer is not tok:
                self._chat = ChatEncoder(tok)
            try:  # client text tokenized as text: no forged control tokens (engine/_prompt.py)
                return self._chat.encode(messages, template_kwargs)
            except Exception as exc:
                raise InvalidRequestError(f"the chat template failed: {exc}", param="messages") from exc
        if isinstance(value, str):
            return list(tok.encode(value))
        ids = list(value)
        vocab = self.info.vocab_size if self.info else 0
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < (vocab or 2**31) for i in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        return ids

    async def count_chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> int:
        """The prompt tokens `chat()` would submit for these messages and tools, without
        submitting anything (Anthropic's count_tokens). Tokenizes in a worker thread."""
        self._check_open()
        options = {"tools": tools, "tool_choice": tool_choice} if tools is not None else {}
        structure = check_structure(self.tokenizer, options, chat=True)
        kwargs = structure.template_kwargs()
        if continue_final_message:
            kwargs["continue_final_message"] = True
        prompt = await trio.to_thread.run_sync(
            self.encode_prompt, "chat", messages, kwargs or None, limiter=_tokenizer_limiter())
        return len(prompt)

    async def _prepare(self, source: tuple[str, Any, Any], opts: dict[str, Any]) -> tuple[list[int], int, SamplingParams, frozenset[int], tuple[str, ...]]:
        self._check_open()
        given = {k: v for k, v in opts.items() if v is not None}  # a request's own values win
        sampling, stop_strings, stop_ids, ignore_eos = _validate({**self.sampling_defaults, **given}, self.info)
        kind, value, template_kwargs = source
        size = prompt_chars(kind, value)
        self._check_size_bound(kind, size, None if opts.get("fit_max_tokens") else opts.get("max_tokens"))
        work = size + (_MESSAGE_CHARS * len(value) if kind == "chat" and isinstance(value, Sequence) else 0)
        if work > _BIG_TOKENIZE_CHARS:
            prompt = await self._tokenize_big(kind, value, template_kwargs)
        elif work > _THREAD_TOKENIZE_CHARS:
            prompt = await trio.to_thread.run_sync(
                self.encode_prompt, kind, value, template_kwargs, limiter=_tokenizer_limiter()
            )
        else:
            prompt = self.encode_prompt(kind, value, template_kwargs)
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt" if kind == "text" else "messages")
        max_tokens = opts.get("max_tokens")
        room = self.context_length - len(prompt)
        if max_tokens is None:
            max_tokens = min(room, self.default_max_tokens) if self.default_max_tokens else room
        elif opts.get("fit_max_tokens") and room >= 1:
            max_tokens = min(max_tokens, room)
        if room < 1 or max_tokens > room:
            asked = (f"{max_tokens} more were requested" if "max_tokens" in given
                     else "that leaves no room for an answer")
            raise ContextLengthExceededError(
                f"this model's maximum context length is {self.context_length} tokens; the prompt "
                f"has {len(prompt)} tokens and {asked}",
                param="messages" if kind == "chat" else "prompt",
                prompt_tokens=len(prompt), context_length=self.context_length,
            )
        stops = frozenset(stop_ids) | (frozenset() if ignore_eos else self._eos_ids)
        return prompt, max_tokens, sampling, stops, stop_strings


def _trim_memory() -> None:
    """Hand freed heap memory back to the system (glibc keeps it otherwise): after a prompt of
    megabytes, the process's resident size returns to where it was."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        pass


def _number(name: str, value: Any, lo: float, hi: float, *, integer: bool = False) -> Any:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or value != value or not lo <= value <= hi:
        what = "an integer" if integer else "a number"
        raise InvalidRequestError(f"{name} must be {what} in [{lo}, {hi}], got {value!r}", param=name)
    return value


def _validate(opts: Mapping[str, Any], info: ActorInfo | None) -> tuple[SamplingParams, tuple[str, ...], list[int], bool]:
    """Check every option before anything reaches the actor."""
    vocab = info.vocab_size if info else 0
    opts = dict(opts)
    if opts.get("max_tokens") is not None:
        _number("max_tokens", opts["max_tokens"], 1, 2**31, integer=True)
    temperature = float(_number("temperature", opts.get("temperature", 1.0), 0.0, 100.0))
    top_p = float(_number("top_p", opts.get("top_p", 1.0), 0.0, 1.0))
    if top_p == 0.0:
        raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
    top_k = int(_number("top_k", opts.get("top_k", 0) or 0, 0, 2**31, integer=True))
    if vocab and top_k >= vocab:
        top_k = 0  # keeps every token: the same as no top-k
    min_p = float(_number("min_p", opts.get("min_p", 0.0) or 0.0, 0.0, 1.0))
    rep = float(_number("repetition_penalty", opts.get("repetition_penalty", 1.0), 1e-3, 100.0))
    presence = float(_number("presence_penalty", opts.get("presence_penalty", 0.0) or 0.0, -2.0, 2.0))
    frequency = float(_number("frequency_penalty", opts.get("frequency_penalty", 0.0) or 0.0, -2.0, 2.0))
    bias_in = opts.get("logit_bias") or {}
    if not isinstance(bias_in, Mapping):
        raise InvalidRequestError("logit_bias must map token ids to numbers", param="logit_bias")
    bias: list[tuple[int, float]] = []
    named: set[int] = set()
    for k, v in bias_in.items():
        # A JSON key is a string of ASCII digits; the channel API may pass ints. Not int()'s
        # wider reading ("1_0", " +10", other scripts' digits): two keys could name one token.
        if isinstance(k, str) and k.isascii() and k.isdigit():
            tid = int(k)
        elif isinstance(k, int) and not isinstance(k, bool):
            tid = k
        else:
            raise InvalidRequestError(f"logit_bias key {k!r} is not a token id", param="logit_bias")
        if tid in named:
            raise InvalidRequestError(f"logit_bias names token {tid} twice", param="logit_bias")
        named.add(tid)
        if tid < 0 or (vocab and tid >= vocab) or isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise InvalidRequestError(
                f"logit_bias: token id {k!r} must be in [0, {vocab}) with a bias in [-100, 100]", param="logit_bias"
            )
        bias.append((tid, float(v)))
    seed = opts.get("seed")
    if seed is not None:
        seed = int(_number("seed", seed, -(2**63), 2**64 - 1, integer=True)) & 0xFFFFFFFFFFFFFFFF
    top_logprobs = int(_number("top_logprobs", opts.get("top_logprobs", 0) or 0, 0, MAX_TOP_LOGPROBS, integer=True))
    want_logprobs = bool(opts.get("logprobs")) or top_logprobs > 0
    stop = opts.get("stop")
    stops: tuple[str, ...] = ()
    if stop is not None:
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        if len(stops) > MAX_STOP_STRINGS or not all(isinstance(s, str) for s in stops):
            raise InvalidRequestError(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise InvalidRequestError(f"a stop string may have at most {MAX_STOP_CHARS} characters", param="stop")
        stops = tuple(s for s in stops if s)
    stop_ids = list(opts.get("stop_token_ids") or ())
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < (vocab or 2**31) for i in stop_ids):
        raise InvalidRequestError("stop_token_ids must be token ids of this model", param="stop_token_ids")
    sampling = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=rep,
        presence_penalty=presence,
        frequency_penalty=frequency,
        logit_bias=tuple(bias),
        seed=seed,
        logprobs=want_logprobs,
        top_logprobs=top_logprobs,
    )
    return sampling, stops, stop_ids, bool(opts.get("ignore_eos"))


class RequestStream:
    """One request's events. `async with` submits it; iterate for `TextDelta`s then one
    `Finished`; leaving the block early aborts the sequence on the actor."""

    def __init__(self, engine: Engine, source: tuple[str, Any, Any], opts: dict[str, Any],
                 prepared: tuple[Structure, Grammar | None] | None = None):
        self._engine = engine
        self._source = source
        self._opts = opts
        self._prepared = prepared  # a sibling's checked structure and grammar (`again`)
        self._tool_stream: Any = None  # an `_tools.ToolCallStream` when the request has tools
        self._called = False  # whether it reported a call
        self.structure: Structure = NO_STRUCTURE  # the request's checked tools and response format
        self.grammar: Grammar | None = None  # what the actor enforces, if anything
        self._req: _Request | None = None
        self._recv: trio.MemoryReceiveChannel[Any] | None = None
        self._pending: collections.deque[Event] = collections.deque()
        self._done = False
        self.prompt_tokens: list[int] = []
        self.completion_tokens = 0
        self.clamped = False

    async def __aenter__(self) -> RequestStream:
        engine = self._engine
        engine._check_open()
        kind, value, template_kwargs = self._source
        if self._prepared is None:
            structure = check_structure(engine.tokenizer, self._opts, chat=kind == "chat")
            if structure.uses_tools:
                template_kwargs = {**(template_kwargs or {}), **structure.template_kwargs()}
        else:
            structure = self._prepared[0]
        prompt, max_tokens, sampling, stop_ids, stop_strings = await engine._prepare(
            (kind, value, template_kwargs), self._opts)
        if self._prepared is None:
            grammar = await compile_structure(engine.tokenizer, engine.model_path, structure)
        else:
            grammar = self._prepared[1]
        continuing = kind == "chat" and bool((template_kwargs or {}).get("continue_final_message"))
        if grammar is not None:
            if continuing:
                raise InvalidRequestError("a continued message (continue_final_message, a prefill) cannot be "
                                          "held to response_format or a required tool_choice: the grammar "
                                          "would start mid-message", param="messages")
            from ._grammar import check_max_tokens

            check_max_tokens(grammar, max_tokens)
            stop_ids = stop_ids | engine._eos_ids  # the grammar ends on EOS, ignore_eos or not
        self.structure, self.grammar = structure, grammar
        self._tool_stream = structure.tool_stream(engine.tokenizer, prompt, grammar)
        self.prompt_tokens = prompt
        self.max_tokens = max_tokens
        asked = self._opts.get("max_tokens")
        self.clamped = isinstance(asked, int) and max_tokens < asked  # fit_max_tokens cut it to the context
        self._sampling = sampling
        self._stop_ids = stop_ids
        self._stopper = StopMatcher(stop_strings)
        self._detok = engine.tokenizer.detokenizer
        if self._source[0] == "text" or continuing:  # a continuation: " Paris" after "is"
            keep_leading_space(self._detok)
        self._held_logprobs = HeldLogprobs()
        self._hidden = engine._special_ids
        self._req = engine._submit(prompt, max_tokens, sampling, stop_ids, grammar)
        self._recv = self._req.recv
        return self

    def again(self, **options: Any) -> RequestStream:
        """Another request for the same prompt, tools and response format as this
        entered one (tokenized and compiled once), with `options` changed: OpenAI's
        `n` choices, each with its own seed."""
        if self._req is None:
            raise RuntimeError("again() needs a stream that was entered")
        opts = {k: v for k, v in self._opts.items() if k not in _STRUCTURE_OPTIONS}
        opts.update(options)
        return RequestStream(self._engine, ("text", list(self.prompt_tokens), None), opts,
                             (self.structure, self.grammar))

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def close(self, cause: str = "cancelled") -> None:
        """End the request; if it is still running, abort it, counted under `cause`
        (statistics().aborts_by_cause). Synchronous and non-blocking: safe in any
        `finally` (docs/design.md, rule 4)."""
        if self._req is not None:
            self._engine._abort(self._req, cause)
        if self._recv is not None:
            self._recv.close()
        self._done = True

    @property
    def stage(self) -> str:
        """"queued", "prefill", "decode" or "done"."""
        req = self._req
        return req.stage if req is not None and req.rid in self._engine._requests else "done"

    @property
    def unread(self) -> int:
        """Tokens the engine has delivered that this stream's reader has not taken yet."""
        return self._recv.statistics().current_buffer_used if self._recv is not None and not self._done else 0

    async def wait_ended(self) -> None:
        """Return once the request has ended (at once if it has): for a reader that
        paces itself, so that a stream's last tokens and its end are never held back."""
        if not self._done and self._req is not None:
            await self._req.ended.wait()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        while True:
            if self._pending:
                return self._pending.popleft()
            if self._done or self._recv is None:
                raise StopAsyncIteration
            try:
                item = await self._recv.receive()
            except trio.EndOfChannel:
                self._end("error", error="the engine dropped this request")
                continue
            batch = [item]
            while True:  # tokens already waiting go out together (adaptive coalescing)
                try:
                    batch.append(self._recv.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break  # Closed: close() ran (another task) after this task was handed `item`
            self._process(batch)

    def _process(self, batch: list[Any]) -> None:
        ids: list[int] = []
        lps: list[TokenLogprob] | None = [] if self._sampling.logprobs else None
        text: list[str] = []
        detok, stopper = self._detok, self._stopper
        held = self._held_logprobs  # logprobs go out with their text (stop strings hold both)
        for item in batch:
            if isinstance(item, _Terminal):
                text.append(stopper.flush())
                if lps is not None:
                    lps += held.rest()
                self._emit(text, ids, lps)
                self._end(item.finish_reason, error=item.error)
                return
            assert isinstance(item, TokenOut)
            tok = item.token
            self.completion_tokens += 1
            ids.append(tok)
            ends_on_stop_token = item.finish_reason == "stop" and tok in self._stop_ids
            if lps is not None and item.logprob is not None and not ends_on_stop_token:
                held.token(self._logprob(item))
            if not ends_on_stop_token and tok not in self._hidden:
                detok.add_token(tok)
            if item.finish_reason is not None:
                detok.finalize()
            segment = released = detok.last_segment
            if stopper:
                released, matched = stopper.feed(segment)
                if matched is not None:
                    text.append(released)
                    if lps is not None:
                        lps += held.text(segment, released)  # the stop string's tokens stay out
                    self._emit(text, ids, lps)
                    if self._req is not None:
                        self._engine._abort(self._req, "stop_string")
                    self._end("stop", stop=matched)
                    return
            text.append(released)
            if lps is not None:
                lps += held.text(segment, released)
            if item.finish_reason is not None:
                text.append(stopper.flush())
                if lps is not None:
                    lps += held.rest()
                self._emit(text, ids, lps)
                self._end(item.finish_reason, stop=tok if ends_on_stop_token else None)
                return
        self._emit(text, ids, lps)

    def _logprob(self, item: TokenOut) -> TokenLogprob:
        dec = self._engine.tokenizer.decode
        top = tuple((i, dec([i]), lp) for i, lp in (item.top_logprobs or ()))
        return TokenLogprob(item.token, dec([item.token]), float(item.logprob or 0.0), top)

    def _emit(self, text: list[str], ids: list[int], lps: list[TokenLogprob] | None) -> None:
        joined = "".join(text)
        if self._tool_stream is not None:
            self._emit_split(self._tool_stream.feed(joined) if joined else None, ids, lps)
        elif joined or ids:
            self._pending.append(TextDelta(joined, tuple(ids), tuple(lps) if lps is not None else None))

    def _emit_split(self, delta: Any, ids: list[int], lps: list[TokenLogprob] | None) -> None:
        """A ToolCallStream's delta, in its text's order: reasoning and the content before
        any call as one TextDelta (with the token ids), then the calls' `ToolCallDelta`s,
        whole calls (`ToolCalls`) and later content. Call text the family's parser
        could not read is content: nothing the model wrote is lost (vLLM does the same)."""
        items: tuple[Any, ...] = delta.items if delta is not None else ()
        lead = 0
        while lead < len(items) and type(items[lead]) is str:
            lead += 1
        content = "".join(items[:lead])
        reasoning = delta.reasoning if delta is not None else ""
        if content or reasoning or ids:
            self._pending.append(TextDelta(content, tuple(ids), tuple(lps) if lps is not None else None, reasoning))
        whole: list[ToolCall] = []
        for item in items[lead:]:
            if type(item) is ToolCall:
                whole.append(item)
                continue
            if whole:
                self._called = True
                self._pending.append(ToolCalls(tuple(whole)))
                whole = []
            if type(item) is ToolCallDelta:
                self._pending.append(item)
            else:  # content after a call, or a refused call's text
                self._pending.append(TextDelta(item if type(item) is str else item.text, ()))
        if whole:
            self._called = True
            self._pending.append(ToolCalls(tuple(whole)))

    def _end(self, reason: str, *, error: str | None = None, stop: str | int | None = None) -> None:
        if self._tool_stream is not None:
            stream, self._tool_stream = self._tool_stream, None
            self._emit_split(stream.finish(), [], None)
            if self._called and reason == "stop":
                reason = "tool_calls"
        self._pending.append(
            Finished(reason, Usage(len(self.prompt_tokens), self.completion_tokens,  # type: ignore[arg-type]
                                   self._req.cached if self._req is not None else 0), error, stop)
        )
        self._done = True
        if self._recv is not None:
            self._recv.close()


_STRUCTURE_OPTIONS = frozenset({"tools", "tool_choice", "parallel_tool_calls", "response_format"})


@asynccontextmanager
async def open_engine(model: str | os.PathLike[str] | None = None, **options: Any) -> AsyncIterator[Engine]:
    """Load `model` (a hub id, a local MLX directory, or None for the embedded default),
    start its GPU actor and yield the ready `Engine`; close it on exit.

    Options: max_batch, prefill_batch, prefill_step, prefill_budget, max_queue, cache_dir, warmup,
    switch_interval, actor ("thread" or "process"), admit_window, sampling_defaults (None:
    the model's generation_config.json), the actor knobs retire_steps, decode_step, idle_release,
    cache_limit_gb, step_trace, prompt_cache_gb, prompt_cache_disk_gb (see `Engine`, `ActorConfig`), and
    restart_limit, restart_window, restart_backoff (a dead actor restarted: `_supervise.py`)."""
    engine = Engine(model, **options)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            try:
                yield engine
            finally:
                with trio.CancelScope(shield=True):
                    await engine.aclose()
    except BaseExceptionGroup as group:
        # The nursery is an implementation detail: a lone error (a load
        # failure, or the caller's own exception) comes out as itself.
        if len(group.exceptions) == 1:
            exc = group.exceptions[0]
            raise exc from exc.__cause__
        raise
