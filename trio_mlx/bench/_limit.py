"""`trio-mlx bench --limit`: the raw ceilings' levels, measured as the HTTP levels are.

The ceilings themselves (mlx_lm's BatchGenerator in a closed loop, and MLX's
bare pipelined decode forward over plain KV caches, no server) are
`trio_mlx.actor.ceiling`, the one place outside the server's actor that drives
MLX; this module makes the records they fill and turns them into levels, each
labelled by its `ceiling` ("batchgenerator" or "bare").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from . import _physical
from ._stats import RequestRecord, check_length, in_process_level

CEILINGS = ("batchgenerator", "bare")

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


def _wave(ceiling: Any, rows: Sequence[Sequence[int]],
          max_tokens: int) -> tuple[dict[str, Any], list[RequestRecord], float]:
    """One wave of the bare forward over `rows`, each making `max_tokens` tokens: the wave
    (`Ceiling.bare`), a record per row, and the wave's seconds."""
    wave = ceiling.bare(rows, max_tokens)
    times = [wave["ttft"], *wave["token_times"]]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    records = [RequestRecord(ttft=wave["ttft"], e2e=times[-1], output_tokens=max_tokens, events=max_tokens,
                             itl=list(gaps), finish_reason="length") for _ in rows]  # fmt: skip
    for r in records:
        check_length(r, max_tokens)
    return wave, records, times[-1]


def bare_waves(ceiling: Any, prompts: Sequence[Sequence[int]], concurrency: int,
               max_tokens: int) -> tuple[list[RequestRecord], float, float]:
    """`prompts` through the bare forward in waves of `concurrency` rows, one after another
    (a closed loop's shape without its overlap: each wave starts when the last ends), as
    `ceiling_level` returns a closed loop's: (records, seconds, CPU seconds)."""
    records: list[RequestRecord] = []
    seconds = cpu = 0.0
    for lo in range(0, len(prompts), concurrency):
        wave, recs, took = _wave(ceiling, prompts[lo : lo + concurrency], max_tokens)
        records += recs
        seconds += took
        cpu += wave["cpu_s"]
    return records, seconds, cpu


def bare_level(ceiling: Any, prompts: Sequence[Sequence[int]], concurrency: int,
               max_tokens: int) -> dict[str, Any]:
    """The bare forward's level at `concurrency`: one wave of its first `concurrency` prompts
    (fewer if the level has fewer), each row making `max_tokens` tokens, as a level record:
    out tok/s over the wave's whole time (its one prefill included, as each closed-loop
    request has one), TPOT = `ms_per_step`, the decode step's time, and `decode_tok_s`."""
    rows = list(prompts[:concurrency])
    wave, records, took = _wave(ceiling, rows, max_tokens)
    lv = in_process_level(records, duration=took, concurrency=concurrency, cpu_s=wave["cpu_s"],
                          cpu_name="client")  # fmt: skip
    steps = max_tokens - 1
    lv.update({
        "ceiling": "bare",
        "rows": len(rows),
        "ms_per_step": 1e3 * wave["decode_s"] / steps if steps and wave["decode_s"] > 0 else None,
        "decode_tok_s": len(rows) * steps / wave["decode_s"] if steps and wave["decode_s"] > 0 else None,
    })
    return lv


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
    ceilings: Sequence[str] = CEILINGS,
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """Measure each (concurrency, requests) level of `plan` on each of `ceilings`, consuming
    `prompts` in order: a level's BatchGenerator run, then its bare wave on the first of
    the same prompts, so that the host's drift weighs on both alike.

    The `warmup` prompts run first as one short, unmeasured batch.

    Returns (device description, per-level stats as `_stats.level_stats` makes them, each
    with its `ceiling`, the model's footprint as `_physical.footprint` makes it).
    """
    unknown = set(ceilings) - set(CEILINGS)
    if unknown or not ceilings:
        raise ValueError(f"ceilings: {sorted(unknown) or 'none'}; expected some of {CEILINGS}")
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
        batch_generator="batchgenerator" in ceilings,
    )
    levels: list[dict[str, Any]] = []
    try:
        pos = 0
        for concurrency, n in plan:
            batch = prompts[pos : pos + n]
            pos += n
            done = []
            if "batchgenerator" in ceilings:
                records, duration, cpu = ceiling_level(ceiling, batch, concurrency, max_tokens)
                done.append({**in_process_level(records, duration=duration, concurrency=concurrency,
                                                cpu_s=cpu, cpu_name="client"), "ceiling": "batchgenerator"})  # fmt: skip
            if "bare" in ceilings:
                done.append(bare_level(ceiling, batch, concurrency, max_tokens))
            for lv in done:
                levels.append(lv)
                if on_level is not None:
                    on_level(lv)
        weights, kv_itemsize = ceiling.model_bytes
        footprint = _physical.footprint(weights, kv_itemsize, ceiling.config, "loaded model")
    finally:
        ceiling.close()
    return ceiling_module().device_info(), levels, footprint
