"""MLX's memory as the actor manages it: the buffer cache's bound, the prefill budget by
device, and the figures each step reports."""

from __future__ import annotations

import math

import mlx.core as mx

# Without `ActorTuning.prefill_budget`: the prompt tokens a prefill step may take while rows
# decode, on the CPU (on a GPU: no bound, the steps as before). A judgement call from the one
# measurement we have: on the CPU a 1B model prefilled ~95 tokens/s (eight ~1.9k-token prompts
# in ~160 s, every running stream stopped meanwhile), so 1,024 tokens hold a running stream's
# next token to ~10 s, and 1,024 is also what a group of `prefill_batch` (8) prompts takes at
# the chunk's floor of 128 anyway. On a GPU nothing measured says a smaller step pays: a
# prefill step there costs tens of ms, where cutting a group's prefill into more
# steps would delay its first tokens by as many decode steps for little; a server that wants
# the bound there sets it.
PREFILL_BUDGET_CPU = 1024
# Without `ActorTuning.idle_release`: seconds idle before MLX's buffer cache is
# handed back on a GPU (never on the CPU, where the cache is this process's own heap).
IDLE_RELEASE = 1.0


def apply_cache_limit(gb: float | None) -> None:
    """Bound MLX's buffer cache at `gb` gigabytes (None: MLX's own limit).

    MLX keeps freed buffers for reuse up to a limit of its own, on CUDA 80% of
    the GPU's memory in every process: measured on an H100, a 1B model's
    server process grew to 27 GB under 256 streams (MLX's own peak: 10 GB),
    and a second MLX process on the same GPU ran out of memory. A limit lets
    processes share a GPU, at the price of allocations the cache would have
    saved.
    """
    if gb is not None and math.isfinite(gb):
        mx.set_cache_limit(int(gb * 1e9))


def prefill_budget(value: int | None) -> int:
    """`ActorTuning.prefill_budget` on this device: None is PREFILL_BUDGET_CPU on the CPU and
    no bound (0) on a GPU."""
    if value is not None:
        return value
    return 0 if mx.default_device().type == mx.DeviceType.gpu else PREFILL_BUDGET_CPU


def memory_figures() -> tuple[int, int, int]:
    """MLX's (active, peak, cache) bytes; the cache holds freed buffers kept for reuse."""
    return mx.get_active_memory(), mx.get_peak_memory(), mx.get_cache_memory()


def on_gpu() -> bool:
    return bool(mx.default_device().type == mx.DeviceType.gpu)


def clear_cache() -> None:
    """Hand MLX's buffer cache back (an idle host of several models: `_host.py`)."""
    mx.clear_cache()
