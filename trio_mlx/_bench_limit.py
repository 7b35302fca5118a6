"""The raw ceiling for `trio-mlx bench --limit`: mlx_lm's BatchGenerator, no server.

The same model, prompts and BatchGenerator settings a server would use
(completion batch size, prefill batch size, prefill step size), driven in a
closed loop from this thread: each level keeps `concurrency` sequences in
flight, inserting the next prompt as soon as one finishes, and stops a
sequence only at `max_tokens` (no stop tokens, so EOS is ignored). TTFT runs
from `insert()`; a token's time is when the `next()` that produced it returns,
which is the earliest a server could hand it on. This is the only bench
module that imports MLX.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from trio_mlx._bench_stats import RequestRecord, check_length, in_process_level

if TYPE_CHECKING:
    from trio_mlx._actor import _StepTrace

# Warm-up: one short batch so that kernels are compiled and buffers allocated
# before anything is timed. Arbitrary, just small.
_WARMUP_TOKENS = 4
# TRIO_MLX_CEILING_TRACE=PATH: the measured levels write one line per step to
# PATH in the columns of the server actor's TRIO_MLX_STEP_TRACE (its exchange
# and retired columns 0), so the two can be read side by side.
_TRACE_ENV = "TRIO_MLX_CEILING_TRACE"


def _load_model(model: str) -> Any:
    from trio_mlx._models import load_model, resolve_model

    loaded, _config = load_model(resolve_model(model))
    return loaded


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
    trace: _StepTrace | None = None,
) -> tuple[list[RequestRecord], float]:
    """Run every prompt through `bg`, `concurrency` at a time; (records, seconds).

    With `trace`, one line per step, in the columns the server's actor writes."""
    clock = time.perf_counter
    queue = deque(enumerate(prompts))
    records = [RequestRecord() for _ in prompts]
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
        prompt0 = bg._counters.prompt_tokens if trace is not None else 0
        _, responses = bg.next()
        now = clock()
        if trace is not None:
            trace.row(t_step, 0.0, now - t_step, inserted, len(responses),
                      bg._counters.prompt_tokens - prompt0, len(live), 0, trace.batch_rows(bg))
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
                check_length(rec, max_tokens)
                del live[r.uid]
                finished += 1
        if finished:
            before = len(live)
            admit(finished)
            inserted = len(live) - before
    return records, clock() - t0


class Ceiling:
    """The model loaded into a BatchGenerator with the server's settings, warmed, ready to
    run closed-loop levels; `run_limit` runs a whole sweep, `trio-mlx bench --paired`
    interleaves levels with a server's. Close it when done."""

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
    ):
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator

        from trio_mlx._actor import apply_cache_limit

        apply_cache_limit()  # as the server's actor does: two MLX processes may share one GPU
        mx.random.seed(seed)
        self._trace: _StepTrace | None = None
        self.bg = BatchGenerator(
            _load_model(model),
            max_tokens=max_tokens,
            stop_tokens=None,  # EOS does not stop a sequence: the output length is fixed
            completion_batch_size=completion_batch_size,
            prefill_batch_size=prefill_batch_size,
            prefill_step_size=prefill_step_size,
        )
        try:
            if path := os.environ.get(_TRACE_ENV):
                from trio_mlx._actor import _StepTrace

                self._trace = _StepTrace(path)  # closed in close()
            if warmup:
                drive(self.bg, warmup, len(warmup), _WARMUP_TOKENS)
                # every prefill group size once, as the server's actor warms up
                # (MLX compiles kernels per shape on first use: `Actor._warmup`)
                for k in range(1, prefill_batch_size + 1):
                    drive(self.bg, [warmup[i % len(warmup)] for i in range(k)], k, _WARMUP_TOKENS)
        except BaseException:
            self.close()
            raise

    def drive(
        self, prompts: Sequence[Sequence[int]], concurrency: int, max_tokens: int
    ) -> tuple[list[RequestRecord], float, float]:
        """One closed-loop run: (records, seconds, CPU seconds of this process)."""
        import mlx.core as mx

        cpu0 = time.process_time()
        records, seconds = drive(self.bg, prompts, concurrency, max_tokens, self._trace)
        cpu = time.process_time() - cpu0
        mx.clear_cache()
        return records, seconds, cpu

    def close(self) -> None:
        import mlx.core as mx

        self.bg.close()
        mx.synchronize()
        if self._trace is not None:
            self._trace.close()


def run_limit(
    model: str,
    prompts: Sequence[Sequence[int]],
    *,
    warmup: Sequence[Sequence[int]],
    plan: Sequence[tuple[int, int]],
    max_tokens: int,
    completion_batch_size: int,
    prefill_batch_size: int,
    prefill_step_size: int,
    seed: int = 0,
    on_level: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Measure each (concurrency, requests) level of `plan`, consuming `prompts` in order.

    The `warmup` prompts run first as one short, unmeasured batch.

    Returns (device description, per-level stats as `_bench.level_stats` makes them).
    """
    need = sum(n for _, n in plan)
    if len(prompts) < need:
        raise ValueError(f"{len(prompts)} prompts for {need} requests")
    ceiling = Ceiling(
        model,
        warmup=warmup,
        max_tokens=max_tokens,
        completion_batch_size=completion_batch_size,
        prefill_batch_size=prefill_batch_size,
        prefill_step_size=prefill_step_size,
        seed=seed,
    )
    levels: list[dict[str, Any]] = []
    try:
        pos = 0
        for concurrency, n in plan:
            batch = prompts[pos : pos + n]
            pos += n
            records, duration, cpu = ceiling.drive(batch, concurrency, max_tokens)
            lv = in_process_level(
                records, duration=duration, concurrency=concurrency, cpu_s=cpu, cpu_name="client"
            )
            levels.append(lv)
            if on_level is not None:
                on_level(lv)
    finally:
        ceiling.close()
    return device_info(), levels
