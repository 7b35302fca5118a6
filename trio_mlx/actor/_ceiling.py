"""The raw ceilings of `trio-mlx bench --limit`: mlx_lm's BatchGenerator, and MLX's bare
pipelined decode forward, no server.

BatchGenerator: the same model, prompts and BatchGenerator settings a server would use
(completion batch size, prefill batch size, prefill step size), driven in a
closed loop from this thread: each level keeps `concurrency` sequences in
flight, inserting the next prompt as soon as one finishes, and stops a
sequence only at `max_tokens` (no stop tokens, so EOS is ignored). TTFT runs
from `insert()`; a token's time is when the `next()` that produced it returns,
which is the earliest a server could hand it on.

The bare forward (`bare_level`): B rows prefilled together into mlx-lm's plain
KV caches, in one forward whose output head is taken at the last position, then
greedy decode steps as mlx-lm's single-stream `generate_step` runs them: step
k+1's forward is built and `mx.async_eval`ed before step k's
tokens are read back. No batching bookkeeping, no sampling beyond an argmax:
what the model's forward alone costs a step, the bar a server's decode step is
measured against.

This lives in the actor package because it drives MLX; `trio_mlx.bench` makes the records it fills and
reads the figures.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ._batch import batch_rows, peek_prompt_tokens
from ._shapes import one_position_head
from ._trace import StepTrace

# Warm-up: one short batch so that kernels are compiled and buffers allocated
# before anything is timed. Arbitrary, just small.
_WARMUP_TOKENS = 4


def _load_model(model: str) -> tuple[Any, dict[str, Any]]:
    from ..models import load_model, resolve_model

    return load_model(resolve_model(model))


def model_bytes(model: Any) -> tuple[int, int]:
    """(the sum of a loaded model's parameters' nbytes, the itemsize of the float dtype holding
    most of them: its KV cache's), from which `trio_mlx.bench._physical.footprint` makes the
    model's footprint (the bench imports the actor, never the reverse)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    total = 0
    floats: dict[Any, int] = {}
    params: Any = tree_flatten(model.parameters())
    for _, p in params:
        total += p.nbytes
        if mx.issubdtype(p.dtype, mx.floating):
            floats[p.dtype] = floats.get(p.dtype, 0) + p.nbytes
    kv = max(floats, key=lambda d: floats[d]) if floats else mx.bfloat16
    return total, kv.size


def bare_level(model: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> dict[str, Any]:
    """One wave of the bare pipelined forward: `prompts` (one row each, all of one length)
    prefilled together into plain KV caches, then `max_tokens - 1` greedy decode steps, so
    that each row makes `max_tokens` tokens. Returns per-row times in seconds from the
    start (`ttft`: the prefill's tokens read; `token_times`: every decode step's tokens
    read), `decode_s` (the first token read to the last) and `cpu_s` (this thread's)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    if len({len(p) for p in prompts}) != 1:
        raise ValueError("the bare forward prefills its rows together: prompts of one length")
    if max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    clock = time.perf_counter
    cache = make_prompt_cache(model)

    def step(tok: Any) -> Any:
        out = model(tok[:, None], cache=cache)
        return mx.argmax(out[:, -1, :], axis=-1)

    cpu0 = time.process_time()
    t0 = clock()
    prompt = mx.array([list(p) for p in prompts])
    # One forward over the whole prompt, its output head taken at the last position alone (as
    # the actor's prefill does into an empty batch, `_batch._prompt_end`), not the logits of
    # every position (B x L x vocab). A head by another name left every position's: that graph
    # is dropped unevaluated, and the last token goes in a forward of its own.
    with one_position_head(model, prompt.shape[1] - 1):
        logits = model(prompt, cache=cache)
    if logits.shape[1] != 1:
        cache[:] = make_prompt_cache(model)
        if prompt.shape[1] > 1:
            model(prompt[:, :-1], cache=cache)
            mx.eval([c.state for c in cache])
        logits = model(prompt[:, -1:], cache=cache)
    y = mx.argmax(logits[:, -1, :], axis=-1)
    mx.async_eval(y)
    nxt = None
    if max_tokens > 1:
        nxt = step(y)
        mx.async_eval(nxt)
    y.tolist()
    ttft = clock() - t0
    times: list[float] = []
    for k in range(max_tokens - 1):
        assert nxt is not None
        cur = nxt
        if k < max_tokens - 2:
            nxt = step(cur)
            mx.async_eval(nxt)  # step k+1 is queued before step k's tokens are read
        cur.tolist()
        times.append(clock() - t0)
    cpu = time.process_time() - cpu0
    mx.clear_cache()
    return {"ttft": ttft, "token_times": times, "decode_s": (times[-1] if times else ttft) - ttft,
            "cpu_s": cpu}  # fmt: skip


def device_info() -> dict[str, Any]:
    import mlx.core as mx
    import mlx_lm

    info: dict[str, Any] = {
        "mlx": getattr(mx, "__version__", None),
        "mlx_lm": getattr(mlx_lm, "__version__", None),
        "default_device": str(mx.default_device()),
    }
    try:
        info.update({k: v for k, v in mx.device_info().items() if isinstance(v, str | int | float)})
    except Exception as exc:  # device_info is best-effort description, never fatal
        info["device_info_error"] = repr(exc)
    return info


def drive(
    bg: Any,
    prompts: Sequence[Sequence[int]],
    concurrency: int,
    max_tokens: int,
    records: Sequence[Any],
    check: Callable[[Any, int], None],
    trace: StepTrace | None = None,
) -> float:
    """Run every prompt through `bg`, `concurrency` at a time, filling `records` (one per
    prompt: ttft, itl, output_tokens, events, finish_reason, e2e, error, message; `check`
    judges each finished one against `max_tokens`); returns the seconds it took.

    With `trace`, one line per step, in the columns the server's actor writes."""
    clock = time.perf_counter
    queue = deque(enumerate(prompts))
    live: dict[int, list[Any]] = {}  # uid -> [t_insert, t_last_token, record]

    def admit(k: int) -> None:
        batch = [queue.popleft() for _ in range(min(k, len(queue)))]
        if not batch:
            return
        now = clock()
        uids = bg.insert([list(p) for _, p in batch], max_tokens=[max_tokens] * len(batch))
        for uid, (i, _) in zip(uids, batch, strict=True):
            live[uid] = [now, now, records[i]]

    t0 = clock()
    admit(concurrency)
    idle, inserted = 0, len(live)
    while live:
        t_step = clock()
        prompt0 = peek_prompt_tokens(bg) if trace is not None else 0
        _, responses = bg.next()
        now = clock()
        if trace is not None:
            trace.row(t_step, 0.0, now - t_step, inserted, len(responses),
                      peek_prompt_tokens(bg) - prompt0, len(live), 0, batch_rows(bg))
            inserted = 0
        if not responses:
            idle += 1
            if idle > 100_000:  # arbitrary: far more prefill steps than any sane prompt needs
                raise RuntimeError("BatchGenerator made no tokens in 100000 steps")
            continue
        idle = 0
        finished = 0
        for r in responses:
            st = live[r.uid]
            rec = st[2]
            if rec.ttft is None:
                rec.ttft = now - st[0]
            else:
                rec.itl.append(now - st[1])
            st[1] = now
            rec.output_tokens += 1
            rec.events += 1
            if r.finish_reason is not None:
                rec.finish_reason = r.finish_reason
                rec.e2e = now - st[0]
                if r.finish_reason != "length":
                    rec.error = f"finish_{r.finish_reason}"
                    rec.message = f"finished with {r.finish_reason!r}"
                check(rec, max_tokens)
                del live[r.uid]
                finished += 1
        if finished:
            before = len(live)
            admit(finished)
            inserted = len(live) - before
    return clock() - t0


class Ceiling:
    """The model loaded into a BatchGenerator with the server's settings, warmed, ready to
    run closed-loop levels; `run_limit` runs a whole sweep, `trio-mlx bench --paired`
    interleaves levels with a server's. `bare` runs the bare forward's waves on the same
    model (with `batch_generator=False`, nothing else: no BatchGenerator is made).
    Close it when done."""

    def __init__(
        self,
        model: str,
        *,
        warmup: Sequence[Sequence[int]],
        max_tokens: int,
        completion_batch_size: int,
        prefill_batch_size: int,
        prefill_step_size: int,
        seed: int = 0,
        cache_limit_gb: float | None = None,
        trace: str | None = None,
        batch_generator: bool = True,
    ):
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator

        from ._memory import apply_cache_limit

        apply_cache_limit(cache_limit_gb)  # as the server's actor does: two MLX processes may share one GPU
        mx.random.seed(seed)
        self._trace: StepTrace | None = None
        self._bare_widths: set[int] = set()
        self.model, self.config = _load_model(model)
        self.model_bytes = model_bytes(self.model)
        self.bg: Any = None
        if not batch_generator:
            return  # `bare` compiles each width's kernels on its first use
        self.bg = BatchGenerator(
            self.model,
            max_tokens=max_tokens,
            stop_tokens=None,  # EOS does not stop a sequence: the output length is fixed
            completion_batch_size=completion_batch_size,
            prefill_batch_size=prefill_batch_size,
            prefill_step_size=prefill_step_size,
        )
        try:
            if trace:
                self._trace = StepTrace(trace)  # closed in close()
            if warmup:
                self._warm(warmup, len(warmup))
                # every prefill group size once, as the server's actor warms up
                # (MLX compiles kernels per shape on first use: `Actor._warmup`)
                for k in range(1, prefill_batch_size + 1):
                    self._warm([warmup[i % len(warmup)] for i in range(k)], k)
        except BaseException:
            self.close()
            raise

    def _warm(self, prompts: Sequence[Sequence[int]], concurrency: int) -> None:
        records = [_Unread() for _ in prompts]
        drive(self.bg, prompts, concurrency, _WARMUP_TOKENS, records, lambda _r, _n: None)

    def drive(
        self, prompts: Sequence[Sequence[int]], concurrency: int, max_tokens: int,
        records: Sequence[Any], check: Callable[[Any, int], None],
    ) -> tuple[float, float]:
        """One closed-loop run filling `records` (see `drive`): (seconds, CPU seconds of this process)."""
        import mlx.core as mx

        if self.bg is None:
            raise RuntimeError("this Ceiling has no BatchGenerator (batch_generator=False)")
        cpu0 = time.process_time()
        seconds = drive(self.bg, prompts, concurrency, max_tokens, records, check, self._trace)
        cpu = time.process_time() - cpu0
        mx.clear_cache()
        return seconds, cpu

    def bare(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> dict[str, Any]:
        """One wave of the bare forward on this model (`bare_level`); the first wave of a
        width compiles its kernels, so each width runs once unmeasured first."""
        if len(prompts) not in self._bare_widths:
            bare_level(self.model, prompts, _WARMUP_TOKENS)
            self._bare_widths.add(len(prompts))
        return bare_level(self.model, prompts, max_tokens)

    def close(self) -> None:
        import mlx.core as mx

        if self.bg is not None:
            self.bg.close()
        mx.synchronize()
        if self._trace is not None:
            self._trace.close()


class _Unread:
    """A record of a warm-up request, which nobody reads."""

    def __init__(self) -> None:
        self.ttft: float | None = None
        self.e2e: float | None = None
        self.itl: list[float] = []
        self.output_tokens = self.events = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.message: str | None = None
