"""Per-request samplers and logits processors, built on mlx-lm's sample_utils, for mlx-lm's step.

The actor's own decode step (`_decode.py`, the default) samples the whole batch
at once and uses none of these but `_mix64`; with `decode_step="mlx"` every
sampling option is served inside the shared batch this way: a row carries its own
sampler and processors (mlx-lm's BatchGenerator applies them per row). Samplers
of equal parameters are shared (`SamplerCache`), so a batch whose rows sample
alike makes one batched call per step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_repetition_penalty

from ._protocol import SamplingParams, TokenOut

# Sampler objects are shared between requests with equal parameters so that a
# batch whose rows sample alike makes ONE batched sampler call per step (the
# BatchGenerator compares samplers by identity). The bound is arbitrary: it
# only stops a stream of distinct temperatures from growing the dict forever.
_SAMPLER_CACHE_SIZE = 256


class SamplerCache:
    """The sampler for a row: None for greedy (the generator's batched argmax), a fresh one
    for a seeded request (it owns its PRNG), else one shared by equal parameters."""

    def __init__(self) -> None:
        self._samplers: dict[tuple[float, float, int, float], Any] = {}

    def get(self, sp: SamplingParams) -> Any:
        if sp.greedy:
            return None
        if sp.seed is not None:
            return make_sampler(sp)
        key = (sp.temperature, sp.top_p, sp.top_k, sp.min_p)
        sampler = self._samplers.get(key)
        if sampler is None:
            if len(self._samplers) >= _SAMPLER_CACHE_SIZE:
                self._samplers.clear()
            sampler = self._samplers[key] = make_sampler(sp)
        return sampler

    def clear(self) -> None:
        self._samplers.clear()


def _mix64(seed: int, counter: int) -> int:
    """splitmix64 of (seed, counter): independent, reproducible per-step PRNG keys."""
    z = (seed * 0x9E3779B97F4A7C15 + (counter + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def make_sampler(sp: SamplingParams) -> Callable[[mx.array], mx.array]:
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


def make_processors(sp: SamplingParams, prompt_len: int, context: int) -> list[Any]:
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


def add_logprobs(out: list[TokenOut], rows: list[tuple[int, Any, Any]]) -> None:
    """mlx-lm's step: the chosen token's logprob and the top-k alternatives for the rows that
    asked (`(index in out, the generator's response, the Seq)`), in one eval."""
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
