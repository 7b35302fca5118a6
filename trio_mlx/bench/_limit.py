"""`trio-mlx bench --limit`: the raw ceiling's levels, measured as the HTTP levels are.

The ceiling itself (mlx_lm's BatchGenerator in a closed loop, no server) is
`trio_mlx.actor.ceiling`, the one place outside the server's actor that drives
MLX; this module makes the records it fills and turns them into levels.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from ._stats import RequestRecord, check_length, in_process_level

# TRIO_MLX_CEILING_TRACE=PATH: the measured levels write one line per step to
# PATH in the columns of the server actor's TRIO_MLX_STEP_TRACE (its exchange
# and retired columns 0), so the two can be read side by side.
CEILING_TRACE_ENV = "TRIO_MLX_CEILING_TRACE"


def ceiling_module() -> ModuleType:
    """`trio_mlx.actor.ceiling`, imported on first use: it imports MLX."""
    from .. import actor

    return actor.ceiling  # type: ignore[no-any-return]


def drive(bg: Any, prompts: Sequence[Sequence[int]], concurrency: int, max_tokens: int,
          trace: Any = None) -> tuple[list[RequestRecord], float]:
    """The ceiling's closed loop on `bg`: (records, seconds)."""
    records = [RequestRecord() for _ in prompts]
    seconds = ceiling_module().drive(bg, prompts, concurrency, max_tokens, records, check_length, trace)
    return records, seconds


def ceiling_level(ceiling: Any, prompts: Sequence[Sequence[int]], concurrency: int,
                  max_tokens: int) -> tuple[list[RequestRecord], float, float]:
    """One closed-loop run on a warm `Ceiling`: (records, seconds, CPU seconds)."""
    records = [RequestRecord() for _ in prompts]
    seconds, cpu = ceiling.drive(prompts, concurrency, max_tokens, records, check_length)
    return records, seconds, cpu


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
    cache_limit_gb: float | None = None,
    on_level: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Measure each (concurrency, requests) level of `plan`, consuming `prompts` in order.

    The `warmup` prompts run first as one short, unmeasured batch.

    Returns (device description, per-level stats as `_stats.level_stats` makes them).
    """
    need = sum(n for _, n in plan)
    if len(prompts) < need:
        raise ValueError(f"{len(prompts)} prompts for {need} requests")
    ceiling = ceiling_module().Ceiling(
        model,
        warmup=warmup,
        max_tokens=max_tokens,
        completion_batch_size=completion_batch_size,
        prefill_batch_size=prefill_batch_size,
        prefill_step_size=prefill_step_size,
        seed=seed,
        cache_limit_gb=cache_limit_gb,
        trace=os.environ.get(CEILING_TRACE_ENV),
    )
    levels: list[dict[str, Any]] = []
    try:
        pos = 0
        for concurrency, n in plan:
            batch = prompts[pos : pos + n]
            pos += n
            records, duration, cpu = ceiling_level(ceiling, batch, concurrency, max_tokens)
            lv = in_process_level(
                records, duration=duration, concurrency=concurrency, cpu_s=cpu, cpu_name="client"
            )
            levels.append(lv)
            if on_level is not None:
                on_level(lv)
    finally:
        ceiling.close()
    return ceiling_module().device_info(), levels
