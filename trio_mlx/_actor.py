"""The GPU actor: the one thread that owns the model, the BatchGenerator and every mx.array.

Its whole life is ONE `trio.to_thread.run_sync(actor.run, ...)` call made by
the engine (DESIGN.md rule 1): MLX streams are thread-local, so loading,
warm-up, every insert/next/remove and the final cleanup happen here. Once per
decode step it crosses into trio exactly once (`link.exchange(report)`),
handing over every token of the step and taking back new commands; when the
batch is empty it blocks in `link.wait_commands()` and burns no CPU. The same
actor runs on the main thread of a child process with a pipe for its link
(`_actor_process.py`, `Engine(actor="process")`).

This module and `_models` are the only ones that import MLX. Token ids and
floats leave it; arrays never do.
"""

from __future__ import annotations

import collections
import functools
import gc
import itertools
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import trio
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_repetition_penalty

from . import _models
from ._messages import (
    Abort,
    ActorConfig,
    ActorInfo,
    Command,
    FinishReason,
    SamplingParams,
    Shutdown,
    StepReport,
    Submit,
    TokenOut,
)

# Sampler objects are shared between requests with equal parameters so that a
# batch whose rows sample alike makes ONE batched sampler call per step (the
# BatchGenerator compares samplers by identity). The bound is arbitrary: it
# only stops a stream of distinct temperatures from growing the dict forever.
_SAMPLER_CACHE_SIZE = 256
# MLX memory figures ride along with one step report in this many, and with
# the report of a step that leaves the batch empty (so an idle server's figures
# are current); the number is arbitrary, small enough for a scrape to see it move.
_MEMORY_EVERY = 64
# TRIO_MLX_STEP_TRACE=PATH: the actor appends one tab-separated line per step
# (see `_StepTrace`) to PATH; a tool for finding where a step's time goes.
_TRACE_ENV = "TRIO_MLX_STEP_TRACE"
_WARMUP_PROMPT = 128  # tokens per warm-up prompt on a GPU (see warm_up)
# TRIO_MLX_RETIRE_STEPS=N: the most steps a finished sequence's row may stay in
# the batch before it is removed (see `Actor._retire_due`); 0 removes at once.
_RETIRE_ENV = "TRIO_MLX_RETIRE_STEPS"
RETIRE_STEPS = 16
# TRIO_MLX_IDLE_RELEASE=SECONDS: after this long with nothing to do the actor
# hands MLX's buffer cache back (`Actor._idle`); 0 never. Default: 1 s on a GPU,
# never on the CPU, where the cache is this process's own heap.
_IDLE_RELEASE_ENV = "TRIO_MLX_IDLE_RELEASE"
IDLE_RELEASE = 1.0
# TRIO_MLX_CACHE_LIMIT_GB=GB: the most freed-buffer memory MLX keeps for reuse
# (`apply_cache_limit`); unset: MLX's own limit.
_CACHE_LIMIT_ENV = "TRIO_MLX_CACHE_LIMIT_GB"


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


@dataclass
class _Seq:
    rid: int
    uid: int
    prompt_len: int
    sampling: SamplingParams
    max_tokens: int
    stops: frozenset[int]
    stage: str = "queued"
    generated: int = 0


class _Admission:
    """When new sequences enter a decoding batch: together, within a bounded window.

    Every change to the batch's membership costs the GPU host work well beyond
    its size: measured on an H100 with a 1B model decoding 56 sequences
    (`scripts/probe_steps.py`), admitting k prompts cost ~10-15 ms on each of
    the next two steps whether k was 1 or 8, against ~5 ms for a plain decode
    step. Requests that arrive one step apart (HTTP clients never arrive
    together) would each pay that. So while sequences are decoding, a new one
    waits until `prefill_batch` have gathered or the oldest has waited out
    the window, and then they enter together (as TGI's router waits for
    `max_waiting_tokens`). An idle batch admits a group at once: no decode
    step is disturbed, so waiting would only add latency.

    The wait is `window` once `prefill_batch` sequences decode and shrinks in
    proportion below that: a change slows every decoding sequence by a step
    or two, so with few of them it costs few tokens, while the wait costs
    every waiting request its whole length in time to first token. Measured
    on an H100 with the 1B model under Poisson arrivals at 2 requests/s (1-2
    decoding), the full 20 ms window put the median TTFT at 62 ms against 20
    ms for an arrival into an idle batch.

    One group of at most `prefill_batch` enters at a time, and only once the
    previous group has finished its prefill. The BatchGenerator tops its
    prompt batch up to `prefill_batch` each step, so a group of 7 arriving
    while 1 prompt is mid-prefill locks it into alternating steps of 7 and 1
    prompts, each paying a prefill and a batch change at once: 130-230 ms a
    step instead of ~36 ms on an H100 with the 135M model (the step trace in
    BENCHMARKS.md, finding 3). Before the window runs out, only a full group
    enters; the rest wait for more company or the window.

    Sequences that have just finished count as company on its way: a client
    in a loop sends its next request when its stream ends, so a wave that
    finishes together comes back together, a round trip later. Admitted at
    once into the emptied batch, the first to return would enter alone and
    the rest, arriving during its prefill, as a second group: two prefills
    and two batch changes a wave instead of one (the step trace of 8
    concurrent streams on an H100, 1B). So while fewer have arrived than
    finished within the last window, arrivals wait up to window x finished /
    prefill_batch; each admitted arrival takes one finish off the count. A
    lone client (one finished, one back) never waits.
    """

    def __init__(self, window: float, batch: int):
        self.window, self.batch = window, batch
        self.pending: dict[int, tuple[float, Submit]] = {}  # rid -> (arrival, submit), in order
        self._finished: collections.deque[float] = collections.deque()  # when, unmatched by arrivals

    def finished(self, now: float, count: int) -> None:
        """`count` sequences finished (not aborted) at `now`: their clients may be back."""
        if self.window:
            self._finished.extend(itertools.repeat(now, count))

    def add(self, sub: Submit, now: float) -> None:
        self.pending.setdefault(sub.rid, (now, sub))

    def drop(self, rid: int) -> bool:
        return self.pending.pop(rid, None) is not None

    def due(self, now: float, decoding: int, prefilling: bool) -> list[Submit]:
        """The group to insert now, oldest first: `decoding` sequences are
        decoding, `prefilling` if any is still queued or prefilling."""
        pending = self.pending
        if not pending or prefilling:
            return []
        take = min(len(pending), self.batch)
        if decoding and take < self.batch:
            age = now - next(iter(pending.values()))[0]
            if age < self.window * min(1.0, decoding / self.batch):
                return []  # wait for a full group, or the window
        if self._awaiting(now):
            return []  # wait for the clients of sequences that just finished
        for _ in range(min(take, len(self._finished))):
            self._finished.popleft()
        return [pending.pop(rid)[1] for rid in list(itertools.islice(pending, take))]

    def _awaiting(self, now: float) -> float:
        """Seconds the held arrivals may still wait for the clients of sequences that
        finished within the window (0: no such wait)."""
        finished, pending = self._finished, self.pending
        while finished and now - finished[0] > self.window:
            finished.popleft()
        if not pending or min(len(pending), self.batch) >= min(len(finished), self.batch):
            return 0.0
        oldest = next(iter(pending.values()))[0]
        return max(0.0, oldest + self.window * min(1.0, len(finished) / self.batch) - now)

    def hold(self, now: float) -> float:
        """With nothing in the batch: seconds until `due` may admit without new commands
        (0: now, or nothing held); the actor sleeps that long at most."""
        wait = self._awaiting(now)
        return min(wait, self._finished[0] + self.window - now) if wait else 0.0


class _StepTrace:
    """One line per step: wall time, seconds waiting on the engine (the exchange),
    seconds in `BatchGenerator.next()`, sequences inserted this step, tokens
    generated, prompt tokens prefilled, live sequences, finished sequences
    whose rows are still in the batch (retired), and the decoding batch's rows."""

    HEADER = "t\texchange_s\tnext_s\tinserted\tgenerated\tprompt_tokens\tlive\tretired\trows\n"

    def __init__(self, path: str):
        self._f = open(path, "a", buffering=1 << 16)  # closed in close()
        self._f.write(self.HEADER)

    def write(self, t: float, exchange: float, report: StepReport, inserted: int, retired: int,
              rows: int) -> None:
        self.row(t, exchange, report.step_seconds, inserted, len(report.tokens), report.prompt_tokens,
                 report.live, retired, rows)

    def row(self, t: float, exchange: float, next_s: float, inserted: int, generated: int,
            prompt_tokens: int, live: int, retired: int, rows: int) -> None:
        """One line, whoever steps (the ceiling of `trio-mlx bench --limit` writes these too)."""
        self._f.write(f"{t:.6f}\t{exchange:.6f}\t{next_s:.6f}\t{inserted}\t{generated}\t"
                      f"{prompt_tokens}\t{live}\t{retired}\t{rows}\n")

    @staticmethod
    def batch_rows(bg: Any) -> int:
        """The decoding batch's rows, read from the generator's internals: the trace is
        a tool, so best effort."""
        return len(getattr(bg, "_generation_batch", ()))

    def close(self) -> None:
        self._f.close()


def _env_number(name: str, default: float) -> float:
    """A tuning knob from the environment: a number >= 0, else a clear error at startup."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a number >= 0, not {raw!r}")
    return value


def apply_cache_limit() -> None:
    """Bound MLX's buffer cache at TRIO_MLX_CACHE_LIMIT_GB, if set.

    MLX keeps freed buffers for reuse up to a limit of its own, on CUDA 80% of
    the GPU's memory in every process: measured on an H100, a 1B model's
    server process grew to 27 GB under 256 streams (MLX's own peak: 10 GB),
    and a second MLX process on the same GPU ran out of memory. A limit lets
    processes share a GPU, at the price of allocations the cache would have
    saved. Raises ValueError for a value that is not a number >= 0.
    """
    limit = _env_number(_CACHE_LIMIT_ENV, math.inf)
    if math.isfinite(limit):
        mx.set_cache_limit(int(limit * 1e9))


def warm_up(bg: Any, token: int, length: int, groups: int) -> None:
    """Prefill 1, 2, ... `groups` prompts of `length` tokens at once, each group to
    its first tokens. Leaves `bg` empty.

    MLX compiles GPU kernels the first time it meets a shape, and on CUDA
    that can stall a step for seconds: measured on an H100, the first
    prefill of one 100-token prompt into a 4-bit 1B model took 59 s and the
    first of eight 39 s; bf16 models paid 65-350 ms per first visit, 10-25
    ms after (`scripts/probe_steps.py`). Live traffic admits groups of every
    size up to the prefill batch, so each size is visited here, before the
    server reports ready, rather than in the middle of someone's stream.
    The prompt length (128 tokens on a GPU, less for a small context) is a
    judgement call: a typical chat turn. On the CPU, where MLX has no such
    stalls to hide and prefill is slow, one short sequence is enough.
    """
    for k in range(1, groups + 1):
        uids = bg.insert([[token] * length for _ in range(k)], max_tokens=[2] * k)
        _step_until(bg, lambda gen: all(n >= 2 for n in gen.values()), uids)


def _step_until(bg: Any, done: Callable[[dict[int, int]], bool], uids: list[int]) -> None:
    """Call `bg.next()` until `done(tokens generated so far per uid)`; the bound of
    64 steps only guards a bug."""
    generated: dict[int, int] = dict.fromkeys(uids, 0)
    for _ in range(64):
        _, responses = bg.next()
        for r in responses:
            if r.uid in generated:
                generated[r.uid] += 1
        if done(generated):
            return
    raise RuntimeError(f"warm-up: no progress after 64 steps ({generated})")


def _remove_rows(bg: Any, uids: list[int]) -> None:
    """`bg.remove(uids)`, with one read of the decoding batch's padding instead of one per layer.

    mlx_lm's `BatchKVCache.filter` reads the kept rows' left padding back to
    the host (`tolist()`) in every layer, to trim the padding all rows share:
    a GPU round trip per layer. On an H100 the actor's removals of 8 retired
    rows from 56-64 took 10-30 ms each outside `next()` with the 1B model (16
    layers) and 17-45 ms with the 135M (30 layers): 5-7% of the server's time
    at 64-256 streams (BENCHMARKS.md, finding 12). Every layer of a batch is
    filtered, extended and padded alike, so all hold the same padding: here
    the first layer's is read once and every layer filters with it, as the
    stock `filter` would. `scripts/probe_remove.py` measured a removal at 15
    -> 3 ms (1B) and 27 -> 3 ms (135M), with the same tokens. A batch whose
    caches are not all plain `BatchKVCache`s at one position keeps the stock
    path.
    """
    caches = _kv_caches(bg)
    if caches is None:
        bg.remove(uids)
        return
    keep = _KeepRows(caches[0].left_padding.tolist())
    for c in caches:
        c.filter = functools.partial(keep, c)  # shadows the class's filter for this call only
    try:
        bg.remove(uids)
    finally:
        for c in caches:
            vars(c).pop("filter", None)


def _kv_caches(bg: Any) -> list[Any] | None:
    """The decoding batch's per-layer caches if all are plain `BatchKVCache`s at one
    position (so they share their padding), else None."""
    batch = getattr(bg, "_generation_batch", None)
    caches = list(getattr(batch, "prompt_cache", None) or ())
    if not caches or any(type(c) is not BatchKVCache or c._idx != caches[0]._idx for c in caches):
        return None
    return caches


class _KeepRows:
    """`BatchKVCache.filter` with the rows' left padding known on the host: the same
    arrays as the stock method, without reading the padding back."""

    __slots__ = ("padding",)

    def __init__(self, padding: list[int]):
        self.padding = padding

    def __call__(self, c: Any, batch_indices: list[int]) -> None:
        kept = [self.padding[i] for i in batch_indices]
        shift = min(kept)
        rows = mx.array(batch_indices)
        if c.keys is not None:
            c.keys, c.values = c.keys[rows], c.values[rows]
        c.offset = c.offset[rows]
        c.left_padding = mx.array([p - shift for p in kept])
        if shift > 0:
            if c.keys is not None:
                c.keys, c.values = c.keys[..., shift:, :], c.values[..., shift:, :]
            c._idx -= shift


def _memory() -> tuple[int, int, int]:
    """MLX's (active, peak, cache) bytes; the cache holds freed buffers kept for reuse."""
    return mx.get_active_memory(), mx.get_peak_memory(), mx.get_cache_memory()


def _mix64(seed: int, counter: int) -> int:
    """splitmix64 of (seed, counter): independent, reproducible per-step PRNG keys."""
    z = (seed * 0x9E3779B97F4A7C15 + (counter + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def _make_sampler(sp: SamplingParams) -> Callable[[mx.array], mx.array]:
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0.0 < sp.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, sp.top_p))
    if sp.min_p > 0.0:
        filters.append(lambda x: apply_min_p(x, sp.min_p))
    if sp.top_k > 0:
        filters.append(lambda x: apply_top_k(x, sp.top_k))
    inv_temp = 1.0 / sp.temperature

    if sp.seed is None:

        def sampler(logprobs: mx.array) -> mx.array:
            for f in filters:
                logprobs = f(logprobs)
            return mx.random.categorical(logprobs * inv_temp)

        return sampler

    # A seeded request owns its PRNG: one key per step derived from (seed,
    # step), so its tokens do not depend on what else shares the batch. The
    # keys are made from host integers, never chained through lazy arrays.
    seed, steps = sp.seed, itertools.count()

    def seeded_sampler(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        key = mx.random.key(_mix64(seed, next(steps)))
        return mx.random.categorical(logprobs * inv_temp, key=key)

    return seeded_sampler


def _make_processors(sp: SamplingParams, prompt_len: int, context: int) -> list[Any]:
    """Logits processors for one row; each sees that row's tokens (prompt + generated)."""
    procs: list[Any] = []
    if sp.logit_bias:
        ids = mx.array([i for i, _ in sp.logit_bias])
        vals = mx.array([v for _, v in sp.logit_bias], dtype=mx.float32)
        procs.append(lambda _tokens, logits: logits.at[:, ids].add(vals.astype(logits.dtype)))
    if sp.repetition_penalty != 1.0:
        # HF semantics: prompt and generated tokens alike.
        procs.append(make_repetition_penalty(sp.repetition_penalty, context_size=context))
    if sp.presence_penalty or sp.frequency_penalty:
        # OpenAI semantics: only generated tokens count; frequency accumulates
        # per occurrence (scatter-add), presence applies once (scatter-set).
        presence, frequency = sp.presence_penalty, sp.frequency_penalty

        def penalties(tokens: mx.array, logits: mx.array) -> mx.array:
            generated = tokens[prompt_len:]
            if generated.size == 0:
                return logits
            if frequency:
                logits = logits.at[:, generated].subtract(frequency)
            if presence:
                logits[:, generated] = logits[:, generated] - presence
            return logits

        procs.append(penalties)
    return procs


class Actor:
    """Runs on the GPU thread. Construct on any thread; call `run()` on the GPU thread."""

    def __init__(self, config: ActorConfig, link: ActorLink):
        self.config = config
        self._link = link
        self.thread_id: int | None = None
        self._model: Any = None
        self._bg: BatchGenerator | None = None
        self._context = 0
        self._vocab = 0
        self._steps = 0
        self._seqs: dict[int, _Seq] = {}  # rid -> seq
        self._by_uid: dict[int, _Seq] = {}
        self._samplers: dict[tuple[float, float, int, float], Any] = {}
        self._retired: dict[int, int] = {}  # uid -> step it finished in; rows still in the batch
        self._retire_steps = int(_env_number(_RETIRE_ENV, RETIRE_STEPS))
        self._gpu = False  # set in run(), once the device is known
        self._idle_release: float | None = None  # likewise
        self._admission = _Admission(config.admit_window, config.prefill_batch)
        self._decoding = 0  # sequences of self._seqs in the "decode" stage
        self._inserted = 0  # sequences inserted by the last _apply (for the step trace)

    # -- lifecycle -------------------------------------------------------------

    def run(self) -> None:
        """The actor's whole life. Raises if the model cannot be loaded."""
        self.thread_id = threading.get_ident()
        t0 = time.perf_counter()
        try:
            self._hook("load")
            config = self._load()
            if self.config.warmup:
                self._warmup()
            info = ActorInfo(
                model_type=str(config.get("model_type", "unknown")),
                context_length=self._context,
                vocab_size=int(config.get("vocab_size", 0)),
                thread_id=self.thread_id,
                device=str(mx.default_device()),
                load_seconds=time.perf_counter() - t0,
                pid=os.getpid(),
            )
            self._link.ready(info)
            self._loop()
        finally:
            self._free()

    def _load(self) -> dict[str, Any]:
        """Load the model and make the generator; returns the model's config."""
        apply_cache_limit()
        self._model, config = _models.load_model(self.config.model_path)
        self._context = _models.context_length(config)
        self._vocab = int(config.get("vocab_size", 0))
        self._bg = self._new_generator()
        self._gpu = gpu = mx.default_device().type == mx.DeviceType.gpu
        self._idle_release = _env_number(_IDLE_RELEASE_ENV, IDLE_RELEASE if gpu else 0.0)
        return config

    def _hook(self, stage: str) -> None:
        if self.config.fault_hook is not None:
            self.config.fault_hook(stage)

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self._model,
            max_tokens=1,
            completion_batch_size=self.config.max_batch,
            prefill_batch_size=self.config.prefill_batch,
            prefill_step_size=self.config.prefill_step,
        )

    def _warmup(self) -> None:
        """Visit, before the server reports ready, what live traffic will make MLX
        compile: every prefill group size (`warm_up`), then, on a GPU, a
        rehearsal of the actor's other paths (`_rehearse`)."""
        assert self._bg is not None
        gpu = self._gpu
        length = max(1, min(_WARMUP_PROMPT if gpu else 4, self._context // 2 - 4))
        token = 1 if self._vocab > 1 else 0
        warm_up(self._bg, token, length, self.config.prefill_batch if gpu else 1)
        if gpu and self._context >= length + 16:  # room for the rehearsal's 12 tokens
            self._rehearse(token, length)
        self._reset_batch()
        self._steps = 0

    def _rehearse(self, token: int, length: int) -> None:
        """Serve a short script of requests through the actor's own `_apply` and
        `_step`, as live traffic would; the caller forgets them (`_reset_batch`).

        On CUDA, MLX compiles some kernels (with NVRTC, for seconds) the first
        time an operation meets a dtype, not a shape. The prefill groups of
        `warm_up` never remove a row that others outlive, and the first such
        removal, gathering the kept rows' next tokens (`gather_uint32_int32`),
        stalled a decode step for 3.3 s on an H100 (BENCHMARKS.md, finding 7;
        `scripts/probe_first_visits.py` found the module in MLX's PTX cache).
        Sampling, penalties, logit bias and logprobs have kernels of their own.
        The script: A (greedy) decodes; B (every sampling option, logprobs)
        and C (seeded) join it, padded; A finishes and retires; D enters, so
        A's row leaves with B and C kept, trimming the padding they share; C
        is aborted; the rest finish and the batch runs dry.
        """
        admission = self._admission
        self._admission = _Admission(0.0, self.config.prefill_batch)  # no waiting for company
        prompt = (token,) * length
        every = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
                               presence_penalty=0.5, frequency_penalty=0.5, logit_bias=((token, 1.0),),
                               logprobs=True, top_logprobs=5)
        a, b, c, d = -1, -2, -3, -4  # rids no request has
        script: list[tuple[list[Command], Callable[[collections.Counter[int]], bool]]] = [
            ([Submit(a, prompt, 8, SamplingParams(temperature=0.0), frozenset())], lambda n: n[a] >= 3),
            ([Submit(b, prompt, 12, every, frozenset()),
              Submit(c, prompt, 12, SamplingParams(temperature=0.7, seed=0), frozenset())], lambda n: n[a] >= 8),
            ([Submit(d, prompt, 4, SamplingParams(temperature=0.0), frozenset())], lambda n: n[d] >= 2),
            ([Abort(c)], lambda n: not self._seqs),
        ]
        counts: collections.Counter[int] = collections.Counter()
        try:
            for commands, done in script:
                failed = self._apply(commands)
                for _ in range(64):  # the bound only guards a bug
                    report = self._step(failed or [])
                    if report.failed:
                        raise RuntimeError(f"warm-up rehearsal failed: {report.failed}")
                    counts.update(t.rid for t in report.tokens)
                    if done(counts):
                        break
                    failed = self._apply([])
                else:
                    raise RuntimeError(f"warm-up rehearsal made no progress: {dict(counts)}")
        finally:
            self._admission = admission

    def _free(self) -> None:
        """Drop every array on this thread and synchronize, so the process exits cleanly."""
        self._seqs.clear()
        self._by_uid.clear()
        self._admission.pending.clear()
        self._samplers.clear()
        self._retired.clear()
        try:
            if self._bg is not None:
                self._bg.close()
        finally:
            self._bg = None
            self._model = None
            gc.collect()
            mx.synchronize()
            mx.clear_cache()

    # -- the loop --------------------------------------------------------------

    def _loop(self) -> None:
        # The exchange is synchronous on purpose: while the actor waits in it,
        # it has released the GIL, so the event loop gets a window every step
        # while the GPU computes the next step (async_eval). A fire-and-forget
        # handover (run_sync_soon + a command queue) was measured on an H100
        # and lost: faster at c=1, but 0.62x instead of 0.91x of the raw
        # BatchGenerator at c=256 and 5x the TTFT at c=8 (BENCHMARKS.md).
        report, link = StepReport(), self._link
        trace_path = os.environ.get(_TRACE_ENV)
        trace = _StepTrace(trace_path) if trace_path else None
        clock = time.perf_counter
        try:
            while True:
                link.check()
                self._hook("loop")  # outside the step's recovery: a fault here kills the actor
                t0 = clock()
                commands = link.exchange(report)
                if not commands and not self._seqs:
                    if not self._admission.pending:
                        commands = self._idle()
                    elif hold := self._admission.hold(clock()):  # held for company: sleep, not spin
                        commands = link.wait_commands(hold)
                t1 = clock()
                failed = self._apply(commands)
                if failed is None:
                    return  # Shutdown
                report = self._step(failed)
                if trace is not None:
                    trace.write(t1, t1 - t0, report, self._inserted, len(self._retired), trace.batch_rows(self._bg))
        finally:
            if trace is not None:
                trace.close()

    def _idle(self) -> list[Command]:
        """Nothing to do: block for commands, handing MLX's buffer cache back if
        they take longer than the idle release.

        MLX keeps freed buffers for reuse and never gives them back by itself:
        a bench process that loaded a 1B model beside a server that had just
        served 256 streams ran out of H100 memory. Other processes share that
        memory, and on Apple silicon the whole system does, so an idle server
        gives it back; a busy one never waits this long between steps.
        """
        link, release = self._link, self._idle_release
        if not release:
            return link.wait_commands()
        commands = link.wait_commands(release)
        if commands:
            return commands
        mx.clear_cache()
        commands = link.exchange(StepReport(memory=_memory()))  # the engine's figures, current
        return commands or link.wait_commands()

    def _apply(self, commands: Sequence[Command]) -> list[tuple[int, str]] | None:
        """Apply this step's commands; returns inserts that failed, or None on Shutdown."""
        admission = self._admission
        now = time.perf_counter()
        removes: list[int] = []
        for cmd in commands:
            match cmd:
                case Submit():
                    admission.add(cmd, now)
                case Abort(rid=rid):
                    if not admission.drop(rid) and (seq := self._seqs.pop(rid, None)):
                        del self._by_uid[seq.uid]
                        if seq.stage == "decode":
                            self._decoding -= 1
                        removes.append(seq.uid)
                case Shutdown():
                    return None
        assert self._bg is not None
        subs = admission.due(now, self._decoding, len(self._seqs) > self._decoding)
        aborted = bool(removes)
        if self._retired and (removes or subs or self._retire_due()):
            removes.extend(self._retired)
            self._retired.clear()
        if removes:
            _remove_rows(self._bg, removes)
            if aborted:
                self._hook("removed")
        self._inserted = len(subs)
        if not subs:
            return []
        try:
            uids = self._bg.insert(
                [list(s.prompt) for s in subs],
                max_tokens=[s.max_tokens + self._slack(s) for s in subs],
                samplers=[self._sampler(s.sampling) for s in subs],
                logits_processors=[
                    _make_processors(s.sampling, len(s.prompt), self._context) for s in subs
                ],
            )
        except Exception as exc:  # bad input that slipped past validation
            return [(s.rid, f"insert failed: {exc}") for s in subs]
        for s, uid in zip(subs, uids, strict=True):
            seq = _Seq(s.rid, uid, len(s.prompt), s.sampling, s.max_tokens, s.stop_token_ids)
            self._seqs[s.rid] = seq
            self._by_uid[uid] = seq
        return []

    def _sampler(self, sp: SamplingParams) -> Any:
        if sp.greedy:
            return None  # the generator's batched argmax
        if sp.seed is not None:
            return _make_sampler(sp)
        key = (sp.temperature, sp.top_p, sp.top_k, sp.min_p)
        sampler = self._samplers.get(key)
        if sampler is None:
            if len(self._samplers) >= _SAMPLER_CACHE_SIZE:
                self._samplers.clear()
            sampler = self._samplers[key] = _make_sampler(sp)
        return sampler

    # -- retiring finished rows ---------------------------------------------------
    #
    # The actor, not the BatchGenerator, decides when a sequence has finished
    # (its max_tokens, or one of its stop tokens), and its row may stay in the
    # batch for up to `retire_steps` more steps, generating tokens nobody
    # reads. Removing rows one finishing step at a time costs the host far
    # more than the rows cost the GPU: each removal filters every layer's KV
    # cache with a host synchronization per layer (mlx_lm's
    # `BatchKVCache.filter`), so the next step cannot overlap the last, and
    # the generator also copies out each finished row's cache, which a server
    # never reads. Deferred, the rows leave together, in the step where new
    # sequences enter (the batch changes then anyway), when the batch runs
    # out of live sequences, or when the oldest has waited `retire_steps`.

    def _slack(self, s: Submit) -> int:
        """Steps past max_tokens the generator may run a row: a backstop, never reached
        while retirement works, kept inside the context window."""
        if not self._retire_steps:
            return 0
        return max(0, min(self._retire_steps + 2, self._context - len(s.prompt) - s.max_tokens))

    def _retire_due(self) -> bool:
        """Remove the retired rows now, though nothing enters or leaves: a sequence
        is waiting to prefill (it needs the slots), or the oldest has waited long
        enough. (A batch that ran dry is emptied in `_step`; one whose last live
        sequence is aborted, with the abort.)"""
        return (
            len(self._seqs) > self._decoding
            or self._steps - next(iter(self._retired.values())) >= self._retire_steps
        )

    def _step(self, failed: list[tuple[int, str]]) -> StepReport:
        if not self._seqs:
            return StepReport(failed=tuple(failed), live=len(self._admission.pending), memory=_memory())
        assert self._bg is not None
        t0 = time.perf_counter()
        try:
            self._hook("step")
            prompt_responses, generation_responses = self._bg.next()
            tokens = self._tokens(generation_responses)
        except Exception as exc:
            return self._recover(exc, failed)
        if self._retired and not self._seqs:  # the batch ran dry: nothing left to overlap
            _remove_rows(self._bg, list(self._retired))
            self._retired.clear()
        prefilling, decoding, prompt_tokens = [], [], 0
        for pr in prompt_responses:
            seq = self._by_uid.get(pr.uid)
            if seq is None:
                continue
            if seq.stage == "queued":
                seq.stage = "prefill"
                prefilling.append(seq.rid)
            if pr.end_of_prompt and seq.stage != "decode":
                seq.stage = "decode"
                self._decoding += 1
                decoding.append(seq.rid)
        stats = self._bg._counters
        prompt_tokens = stats.prompt_tokens
        stats.prompt_tokens = 0
        self._steps += 1
        memory = _memory() if self._steps % _MEMORY_EVERY == 1 or not self._seqs else None
        return StepReport(
            memory=memory,
            tokens=tokens,
            prefilling=tuple(prefilling),
            decoding=tuple(decoding),
            failed=tuple(failed),
            prompt_tokens=prompt_tokens,
            step_seconds=time.perf_counter() - t0,
            live=len(self._seqs) + len(self._admission.pending),
        )

    def _tokens(self, responses: Sequence[Any]) -> tuple[TokenOut, ...]:
        out: list[TokenOut] = []
        want_logprobs: list[tuple[int, Any, _Seq]] = []
        ended = 0
        for r in responses:
            seq = self._by_uid.get(r.uid)
            if seq is None:  # a retired row: its tokens are nobody's
                if r.finish_reason is not None:
                    self._retired.pop(r.uid, None)  # the generator dropped it itself
                continue
            seq.generated += 1
            reason: FinishReason | None = (
                "stop" if r.token in seq.stops
                else "length" if seq.generated >= seq.max_tokens
                else r.finish_reason
            )
            if reason is not None:
                ended += 1
                del self._by_uid[r.uid]
                del self._seqs[seq.rid]
                if seq.stage == "decode":
                    self._decoding -= 1
                if r.finish_reason is None:  # still in the batch: retire it
                    self._retired[r.uid] = self._steps
            if seq.sampling.logprobs:
                want_logprobs.append((len(out), r, seq))
            out.append(TokenOut(seq.rid, r.token, reason))
        if ended:
            self._admission.finished(time.perf_counter(), ended)
        if want_logprobs:
            self._add_logprobs(out, want_logprobs)
        return tuple(out)

    def _add_logprobs(self, out: list[TokenOut], rows: list[tuple[int, Any, _Seq]]) -> None:
        """Chosen-token logprob and top-k alternatives for the rows that asked, in one eval."""
        stacked = mx.stack([r.logprobs for _, r, _ in rows])
        chosen = mx.take_along_axis(stacked, mx.array([[r.token] for _, r, _ in rows]), axis=-1)
        k = max(seq.sampling.top_logprobs for _, _, seq in rows)
        idx_l: list[list[int]] = []
        vals_l: list[list[float]] = []
        if k > 0:
            idx = mx.argpartition(-stacked, kth=k - 1, axis=-1)[:, :k]
            vals = mx.take_along_axis(stacked, idx, axis=-1)
            mx.eval(chosen, idx, vals)
            idx_l, vals_l = idx.tolist(), vals.astype(mx.float32).tolist()  # type: ignore[assignment]
        else:
            mx.eval(chosen)
        chosen_l: list[list[float]] = chosen.astype(mx.float32).tolist()  # type: ignore[assignment]
        for row, (i, _, seq) in enumerate(rows):
            top = None
            if seq.sampling.top_logprobs:
                pairs = sorted(zip(idx_l[row], vals_l[row], strict=True), key=lambda p: -p[1])
                top = tuple(pairs[: seq.sampling.top_logprobs])
            t = out[i]
            out[i] = TokenOut(t.rid, t.token, t.finish_reason, chosen_l[row][0], top)

    def _recover(self, exc: BaseException, failed: list[tuple[int, str]]) -> StepReport:
        """A step raised: fail every live sequence, start a fresh generator, keep serving."""
        reason = f"generation step failed: {type(exc).__name__}: {exc}"
        failed = failed + [(rid, reason) for rid in self._seqs]
        self._reset_batch()
        return StepReport(failed=tuple(failed), live=0)

    def _reset_batch(self) -> None:
        """Forget every sequence and start a fresh generator: after a failed step, or the
        warm-up's rehearsal. A generator that fails to close is dropped all the same."""
        self._seqs.clear()
        self._by_uid.clear()
        self._retired.clear()
        self._decoding = 0
        assert self._bg is not None
        try:
            self._bg.close()
        except Exception:
            pass
        self._bg = self._new_generator()  # if even this raises, the actor dies: engine broken
