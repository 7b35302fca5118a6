"""Warm-up: visit, before the server reports ready, every path live traffic will make MLX
compile, so no request pays a kernel compile (seconds on CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

WARMUP_PROMPT = 128  # tokens per warm-up prompt on a GPU (see warm_up)


def warm_up(bg: Any, token: int, length: int, groups: int, row: Callable[[], Any] | None = None) -> None:
    """Prefill 1, 2, ... `groups` prompts of `length` tokens at once, each group to
    its first tokens. Leaves `bg` empty. With `row`, each sequence's sampler is a fresh
    `row()` (the actor's own decode step, `_batch.own_decode`, which ends no row by
    itself: the group is removed once done).

    MLX compiles GPU kernels the first time it meets a shape, and on CUDA
    that can stall a step for seconds (tens of seconds for a 4-bit model's
    first prefill, tens to hundreds of ms for each new group size of a bf16
    one, against a few ms after). Live traffic admits groups of every
    size up to the prefill batch, so each size is visited here, before the
    server reports ready, rather than in the middle of someone's stream.
    The prompt length (128 tokens on a GPU, less for a small context) is a
    judgement call: a typical chat turn. On the CPU, where MLX has no such
    stalls to hide and prefill is slow, one short sequence is enough.
    """
    for k in range(1, groups + 1):
        samplers = None if row is None else [row() for _ in range(k)]
        uids = bg.insert([[token] * length for _ in range(k)], max_tokens=[2] * k, samplers=samplers)
        _step_until(bg, lambda gen: all(n >= 2 for n in gen.values()), uids)
        bg.remove(uids)  # those still there (mlx_lm's own step ends them at max_tokens)


def _step_until(bg: Any, done: Callable[[dict[int, int]], bool], uids: list[int]) -> None:
    """Call `bg.next()` until `done(tokens generated so far per uid)`; the bound of
    64 steps only guards a bug."""
    generated: dict[int, int] = dict.fromkeys(uids, 0)
    for _ in range(64):
        _, responses = bg.next()
        for uid in getattr(responses, "uids", None) or [r.uid for r in responses]:  # `_batch.Decoded`, or a list
            if uid in generated:
                generated[uid] += 1
        if done(generated):
            return
    raise RuntimeError(f"warm-up: no progress after 64 steps ({generated})")


def prebuild_prefill(forward: Any, layers: int, token: int, limit: int, sizes: list[int], stride: int) -> int:
    """Run, once each, the prefill shapes of the grid (`_batch.CausalPrefill`) that fit in
    `limit` tokens of context, for one row: a query of each length in `sizes` behind every
    multiple of `stride` tokens already cached. Returns how many shapes it ran.

    On CUDA, MLX builds a cuDNN graph for every prefill attention shape it meets, at tens
    of ms each, and a chat's turns would otherwise pay one each. `forward` is the grid-prefilling model, so the shapes (and
    the contiguous keys' strides) are the ones live prefills make. Groups of several rows
    meet their shapes live, and these recur: the grid is coarse.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    caches = [BatchKVCache([0]) for _ in range(layers)]
    ran, cached = 0, 0
    while True:
        for q in sizes:
            if cached + q > limit:
                break
            forward(mx.full((1, q), token, dtype=mx.int32), cache=caches)
            mx.eval([a for c in caches for a in (c.keys, c.values)])
            for c in caches:
                c.trim(q)
            ran += 1
        if cached + stride + min(sizes) > limit:  # no query would fit behind one more stride
            return ran
        forward(mx.full((1, stride), token, dtype=mx.int32), cache=caches)
        mx.eval([a for c in caches for a in (c.keys, c.values)])
        cached += stride
