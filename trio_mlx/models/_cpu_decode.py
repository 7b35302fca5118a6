"""A loaded model's decode step made cheaper on MLX's CPU backend: the one place that
swaps layers for CPU-only versions (`install`, called by `models.load_model` on the CPU).

On the embedded default (float32, OpenBLAS, a 2-core x86-64 VM), a one-token
step's CPU goes ~80% to matmuls, ~15% to the layers' other ops (norms, RoPE,
attention, residuals) and the rest to building the graph. Three swaps,
each a subclass put in place with `__class__` (the parameters, their names
and every other path stay as mlx_lm made them; a layer they do not fit keeps
its own `__call__`):

1. One-row matmuls in row blocks (`RowBlockLinear`, `RowBlockEmbedding`,
   with OpenBLAS only). MLX's CPU matmul calls `cblas_sgemm` for every
   shape. OpenBLAS runs a one-row `x @ W.T` with its small-matrix kernel,
   ~14 GB/s of weights at 576 columns, only while W has at most ~1200 rows;
   from 1536 rows up (the MLP's 1536x576 gate/up projections, the tied
   49152x576 output projection) it takes its general path at 6.5-8.5 GB/s,
   where its own `sgemv` reads the same bytes at 13.8. A one-row product
   with a float32 matrix of more than `BLOCK_ROWS` rows is therefore the
   concatenation of products with equal row blocks of at most `BLOCK_ROWS`
   rows: views of the weight (row slices of a row-major matrix share its
   buffer, so nothing is copied), the same dot products up to float32
   rounding (the kernels sum in another order: ~1e-6 apart). Two rows or
   more, and every prompt, keep one matmul.
2. RMSNorm as one compiled function (`CompiledRMSNorm`, float32 inputs):
   on the CPU `mx.fast.rms_norm` cost 30-85 us a call for 576 values, the
   compiled formula ~13 (the same floats here).
3. RoPE of a one-token step as one compiled function (`DecodeRoPE`), with
   `mx.fast.rope`'s own arithmetic (the same floats): MLX's CPU
   `mx.fast.rope` cost 70-80 us a call for 9 heads of 64 values, ~200 with
   the per-row offsets of mlx-lm's `BatchKVCache`; the compiled one ~40.
   Longer inputs (prompts) keep `mx.fast.rope`.

Together: ~13 -> ~18 decode tokens per CPU second on the embedded default
(15.5 -> 20.9 tok/s served on the idle 2-core box), prompts unchanged, the
same greedy tokens (BENCHMARKS.md, "Linux CPU"). MLX compiles (2) and (3)
with the system's C++ compiler the first time; without `g++` it runs them as
separate ops, about as fast as what they replace.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger("trio_mlx.models")

BLOCK_ROWS = 1024  # <= 1200: OpenBLAS's small-matrix kernel (SkylakeX) takes M*N <= 1200


@dataclass(frozen=True, slots=True)
class _Blocks:
    """The row-block views of `weight` (a plain object, so that nn.Module keeps it out of
    the parameter tree)."""

    weight: mx.array
    views: tuple[mx.array, ...]


def _blocks(module: Any) -> _Blocks | None:
    """The module's blocks, rebuilt if its weight was replaced since (e.g. `load_weights`)."""
    weight = module["weight"]
    cached = module.__dict__.get("_row_blocks")
    if cached is not None and cached.weight is weight:
        return cached
    rows = weight.shape[0]
    blocks = None
    if weight.ndim == 2 and weight.dtype == mx.float32 and rows > BLOCK_ROWS:
        size = -(-rows // -(-rows // BLOCK_ROWS))  # equal blocks, each <= BLOCK_ROWS
        blocks = _Blocks(weight, tuple(weight[i:i + size] for i in range(0, rows, size)))
    module.__dict__["_row_blocks"] = _Blocks(weight, ()) if blocks is None else blocks
    return blocks


def matmul_t(x: mx.array, module: Any) -> mx.array:
    """`x @ module.weight.T`, in row blocks when `x` is one row and the weight is large."""
    if x.size == x.shape[-1]:
        blocks = _blocks(module)
        if blocks is not None and blocks.views:
            return mx.concatenate([x @ w.T for w in blocks.views], axis=-1)
    return x @ module["weight"].T


class RowBlockLinear(nn.Linear):
    """`nn.Linear` whose one-row products run in row blocks (`matmul_t`)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = matmul_t(x, self)
        return y + self["bias"] if "bias" in self else y


class RowBlockEmbedding(nn.Embedding):
    """`nn.Embedding` whose `as_linear` (a tied output projection) runs in row blocks."""

    def as_linear(self, x: mx.array) -> mx.array:
        return matmul_t(x, self)


@partial(mx.compile, shapeless=True)
def _rms_norm(x: mx.array, weight: mx.array, eps: mx.array) -> mx.array:
    return weight * (x * mx.rsqrt(mx.mean(mx.square(x), axis=-1, keepdims=True) + eps))


class CompiledRMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` as one compiled function for float32 (what `mx.fast.rms_norm` computes)."""

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        if x.dtype != mx.float32 or weight.dtype != mx.float32:
            return super().__call__(x)
        return _rms_norm(x, weight, mx.array(self.eps, mx.float32))


@mx.compile
def _rope(x: mx.array, offset: mx.array, scale: mx.array, inv_freq: mx.array,
          traditional: bool) -> mx.array:
    """RoPE of `x` (B, H, 1, D) at positions `offset` (a scalar or one per row): angles
    `position * scale * inv_freq`, computed as `mx.fast.rope` does (the same floats)."""
    half = inv_freq.shape[0]
    angles = (offset.astype(mx.float32).reshape(-1, 1, 1, 1) * scale) * inv_freq
    cos, sin = mx.cos(angles), mx.sin(angles)
    head = x[..., :2 * half]
    if traditional:  # rotates (x[2i], x[2i+1]) pairs
        pairs = head.reshape(*head.shape[:-1], half, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        out = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(head.shape)
    else:  # rotates (x[i], x[i + half]) pairs
        x1, x2 = head[..., :half], head[..., half:]
        out = mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    if x.shape[-1] > 2 * half:
        out = mx.concatenate([out, x[..., 2 * half:]], axis=-1)
    return out.astype(x.dtype)


class DecodeRoPE(nn.RoPE):
    """`nn.RoPE` whose one-token calls run as one compiled function (`_rope`)."""

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if x.ndim != 4 or x.shape[-2] != 1 or self.dims % 2 or x.shape[-1] < self.dims:
            return super().__call__(x, offset)
        consts = self.__dict__.get("_rope_consts")
        if consts is None:
            steps = mx.arange(0, self.dims, 2, dtype=mx.float32)
            inv_freq = mx.exp(steps * (-math.log(self.base) / self.dims))
            consts = self.__dict__["_rope_consts"] = (mx.array(self.scale, mx.float32), inv_freq)
        if not isinstance(offset, mx.array):
            offset = mx.array(offset)
        if offset.size not in (1, x.shape[0]):
            return super().__call__(x, offset)
        scale, inv_freq = consts
        return _rope(x, offset, scale, inv_freq, self.traditional)


def install(model: Any, *, row_blocks: bool) -> int:
    """Swap `model`'s layers in place (row blocks only if `row_blocks`); how many were."""
    swaps: dict[type, type] = {nn.RMSNorm: CompiledRMSNorm, nn.RoPE: DecodeRoPE}
    if row_blocks:
        swaps.update({nn.Linear: RowBlockLinear, nn.Embedding: RowBlockEmbedding})
    swapped = 0
    for _, module in model.named_modules():
        new = swaps.get(type(module))
        if new is None or ("weight" in module and module["weight"].dtype != mx.float32):
            continue
        module.__class__ = new
        swapped += 1
    log.debug("CPU decode: %d layers swapped (row blocks %s)", swapped, "on" if row_blocks else "off")
    return swapped
