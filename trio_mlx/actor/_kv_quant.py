"""The quantized KV cache for a batch (`kv_bits`): mlx-lm's `QuantizedKVCache` in
`BatchKVCache`'s left-padded layout, which mlx-lm 0.32 does not have.

A batch's per-layer cache holds every row's keys and values as mlx's quantized triples
(packed data, scales, biases; `mx.quantize` along the head dimension), laid out as
`BatchKVCache` lays out its arrays: rows right-aligned at `_idx`, `left_padding` and
`offset` per row, right padding rolled away by `finalize`. Its `bits` and `group_size`
make mlx-lm's attention take its quantized path (`models.base.scaled_dot_product_attention`
switches on `hasattr(cache, "bits")`), for any model that attends through it.

Every key and value is quantized as it is written, from a sequence's first token on, and
every attention reads the quantized cache: its tokens are those of mlx-lm's own
`generate_step` with a `QuantizedKVCache` per layer as its prompt cache. A token's KV then
depends on the tokens before it alone, not on how they were cut into model calls, so a
row's tokens are the same whatever batch it shares, however the actor chunks its prefill
(a prefill budget while others decode, the attention scratch bound) and whether its prefix
came from the prompt cache. mlx-lm's `kv_bits` instead converts a sequence's cache after the
model call that takes it past `quantized_kv_start` tokens: what came before attends at full
precision, so the tokens depend on where the calls fall (a cached prefix, a chunk cut
elsewhere), and a batch would need rows at two precisions in one attention call. Hence
`ActorTuning.quantized_kv_start` is 0 only.

A sequence's own cache (`RowQuantizedKVCache`: what `BatchGenerator.insert` makes for a new
row, what the prompt cache holds and hands out) is mlx-lm's `QuantizedKVCache` that merges
into a batch. Quantization is per token (each head vector's groups on their own), so a
row's slice of the batch's arrays is that row's quantized KV, exactly: rows move in and
out of batches, and into the prompt cache, by slicing, as plain KV does (`_batch.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import QuantizedKVCache, _BaseCache, dynamic_roll

from ._tuning import KV_GROUP_SIZES


def kv_map(fn: Callable[[Any], Any], kv: Any) -> Any:
    """`fn` over a cache's keys (or values): an array for plain KV, each array of the
    (data, scales, biases) triple for quantized KV."""
    return tuple(fn(a) for a in kv) if isinstance(kv, tuple) else fn(kv)


def kv_arrays(kv: Any) -> list[Any]:
    """The arrays of a cache's keys (or values)."""
    return list(kv) if isinstance(kv, tuple) else [kv]


def kv_length(kv: Any) -> int:
    """The token capacity (axis 2) of a cache's keys (or values)."""
    return int((kv[0] if isinstance(kv, tuple) else kv).shape[2])


class RowQuantizedKVCache(QuantizedKVCache):
    """mlx-lm's `QuantizedKVCache` that merges into a batch (`BatchQuantizedKVCache`): one
    sequence's cache, as `BatchGenerator.insert` makes it and the prompt cache holds it."""

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)


class BatchQuantizedKVCache(_BaseCache):
    """`BatchKVCache` with quantized keys and values: the same layout, methods and
    contracts (`prepare`, `finalize`, `filter`, `extend`, `extract`, `merge`, `trim`,
    `make_mask`), each array of the triples treated as `BatchKVCache` treats its one."""

    step = 256

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        self.keys: Any = None  # (data, scales, biases), each (B, H, capacity, *)
        self.values: Any = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: Any = None
        self.group_size = group_size
        self.bits = bits

    def _quantize(self, x: Any) -> tuple[Any, Any, Any]:
        q = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        return q[0], q[1], q[2]

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        qk, qv = self._quantize(keys), self._quantize(values)
        prev, n = self._idx, keys.shape[2]
        if self.keys is None or prev + n > kv_length(self.keys):
            grow = (self.step + n - 1) // self.step * self.step

            def more(a: Any) -> Any:
                return mx.zeros((*a.shape[:2], grow, a.shape[3]), dtype=a.dtype)

            if self.keys is None:
                self.keys, self.values = kv_map(more, qk), kv_map(more, qv)
            else:
                if prev % self.step:
                    self.keys = kv_map(lambda a: a[..., :prev, :], self.keys)
                    self.values = kv_map(lambda a: a[..., :prev, :], self.values)
                self.keys = tuple(mx.concatenate([a, more(a)], axis=2) for a in self.keys)
                self.values = tuple(mx.concatenate([a, more(a)], axis=2) for a in self.values)
        self.offset = self.offset + n
        self._idx += n
        for buf, new in ((self.keys, qk), (self.values, qv)):
            for a, b in zip(buf, new, strict=True):
                a[..., prev : self._idx, :] = b
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Any, Any]:
        idx = self._idx
        return kv_map(lambda a: a[..., :idx, :], self.keys), kv_map(lambda a: a[..., :idx, :], self.values)

    def prepare(self, *, left_padding: Any = None, lengths: Any = None, right_padding: Any = None) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("Left padding can only be added to an empty BatchQuantizedKVCache")
            pad = mx.array(left_padding)
            self.left_padding += pad
            self.offset = self.offset - pad
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        if self._right_padding is None:
            return
        padding = self._right_padding
        if self.keys is not None:
            self.keys = kv_map(lambda a: dynamic_roll(a, padding[:, None], axis=2), self.keys)
            self.values = kv_map(lambda a: dynamic_roll(a, padding[:, None], axis=2), self.values)
        self.offset = self.offset - padding
        self.left_padding += padding
        self._right_padding = None

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    @property
    def meta_state(self) -> tuple[str, ...]:
        return tuple(map(str, (self.group_size, self.bits)))

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices: Any) -> None:
        """In place: keep the rows `batch_indices`, and drop the left padding they all share."""
        if self.keys is not None:
            self.keys = kv_map(lambda a: a[batch_indices], self.keys)
            self.values = kv_map(lambda a: a[batch_indices], self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        padding: list[int] = self.left_padding.tolist()  # type: ignore[assignment]
        shift = min(padding)
        if shift > 0:
            if self.keys is not None:
                self.keys = kv_map(lambda a: a[..., shift:, :], self.keys)
                self.values = kv_map(lambda a: a[..., shift:, :], self.values)
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """In place: `other`'s rows after these, both right-aligned at the longer `_idx`."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        max_idx = max(self._idx, other._idx)
        size = max(kv_length(c.keys) for c in (self, other) if c.keys is not None)
        like = self if self.keys is not None else other

        def pad(c: BatchQuantizedKVCache) -> tuple[Any, Any, Any, Any]:
            k, v = c.keys, c.values
            if k is None:
                rows = c.offset.shape[0]
                k = tuple(mx.zeros((rows, a.shape[1], 0, a.shape[3]), dtype=a.dtype) for a in like.keys)
                v = tuple(mx.zeros((rows, a.shape[1], 0, a.shape[3]), dtype=a.dtype) for a in like.values)
            left = max_idx - c._idx
            right = size - kv_length(k) - left
            if right < 0:
                k = kv_map(lambda a: a[..., :right, :], k)
                v = kv_map(lambda a: a[..., :right, :], v)
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k = kv_map(lambda a: mx.pad(a, widths), k)
                v = kv_map(lambda a: mx.pad(a, widths), v)
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = pad(self), pad(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2, strict=True))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2, strict=True))
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([p1, p2])
        self._idx = max_idx

    def extract(self, idx: int) -> RowQuantizedKVCache:
        """Row `idx` as a sequence's own cache (exactly its tokens)."""
        cache = RowQuantizedKVCache(self.group_size, self.bits)
        padding: list[int] = self.left_padding.tolist()  # type: ignore[assignment]
        start = padding[idx]
        cache.keys = kv_map(lambda a: mx.contiguous(a[idx : idx + 1, :, start : self._idx]), self.keys)
        cache.values = kv_map(lambda a: mx.contiguous(a[idx : idx + 1, :, start : self._idx]), self.values)
        cache.offset = self._idx - start
        return cache

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        """One batch of sequences' own quantized caches (`RowQuantizedKVCache`), left-padded
        to the longest."""
        group_size, bits = caches[0].group_size, caches[0].bits
        if any(c.group_size != group_size or c.bits != bits for c in caches):
            raise ValueError("quantized caches of different bits or group sizes do not merge")
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), group_size, bits)
        padding = [longest - n for n in lengths]
        like = next(c for c in caches if c.keys is not None)
        rows = len(caches)
        keys = tuple(mx.zeros((rows, a.shape[1], longest, a.shape[3]), dtype=a.dtype) for a in like.keys)
        values = tuple(mx.zeros((rows, a.shape[1], longest, a.shape[3]), dtype=a.dtype) for a in like.values)
        for i, (p, c) in enumerate(zip(padding, caches, strict=True)):
            if c.keys is None:
                continue
            for buf, src in ((keys, c.keys), (values, c.values)):
                for a, b in zip(buf, src, strict=True):
                    a[i : i + 1, :, p : p + c.offset] = b[..., : c.offset, :]
        cache = cls(padding, group_size, bits)
        cache.keys, cache.values = keys, values
        cache.offset += longest
        cache._idx = longest
        return cache

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values))


def check_kv_bits(bits: int, group_size: int, head_dims: tuple[int, ...]) -> None:
    """Raise ValueError unless keys and values of these head dims (keys', values') quantize
    at `bits` in groups of `group_size` and mlx-lm's quantized attention runs on them on
    this device (a one-token attention, evaluated now): a bad combination stops the start."""
    for dim in head_dims:
        if dim % group_size:
            raise ValueError(f"kv_group_size {group_size} must divide the model's head dim ({dim}): "
                             f"try {' or '.join(str(g) for g in KV_GROUP_SIZES if dim % g == 0) or 'another model'}")
    from mlx_lm.models import base  # at call time: `attend_dequantized` may have replaced it

    k_dim, v_dim = head_dims[0], head_dims[-1]
    try:
        keys = mx.quantize(mx.ones((1, 1, 2, k_dim)), group_size=group_size, bits=bits)
        values = mx.quantize(mx.ones((1, 1, 2, v_dim)), group_size=group_size, bits=bits)
        out = base.quantized_scaled_dot_product_attention(mx.ones((1, 1, 1, k_dim)), keys, values, scale=1.0,
                                                          mask=None, group_size=group_size, bits=bits)
        mx.eval(out)
    except Exception as exc:
        raise ValueError(f"kv_bits {bits} with kv_group_size {group_size} does not run on "
                         f"{mx.default_device()}: {exc}") from exc


def attend_dequantized() -> None:
    """Make mlx-lm's quantized attention dequantize the step's keys and values and attend
    with MLX's fused attention (`dequantized_attention`), in this process from now on.

    MLX 0.32.4's CUDA `quantized_matmul` has no kernel for the shapes mlx-lm's quantized
    attention gives it: keys and values batched over (rows, KV heads), one matrix each. On
    an H200 it raised "No implementation for problem shape" (M x N x K x batch: 1x1x64x32
    as mlx-lm asks, 4x1x64x8 with each KV head's query heads folded into its queries), and
    other key lengths at group size 64 sent it to a kernel that failed to compile. MLX's
    `dequantize` is elementwise and its fused attention takes any length, so the cache
    stays quantized in memory (what `kv_bits` is for) and each layer's attention reads a
    transient full-precision copy of it. The actor calls this on CUDA only, where the
    load's check (`_loading.kv_quantization`) then runs this attention."""
    from mlx_lm.models import base

    base.quantized_scaled_dot_product_attention = dequantized_attention


def dequantized_attention(queries: Any, q_keys: Any, q_values: Any, scale: float, mask: Any,
                          group_size: int = 64, bits: int = 8) -> Any:
    """mlx-lm's `quantized_scaled_dot_product_attention` computed as MLX's fused attention
    over the dequantized keys and values: the same keys and values (`dequantize` of the
    triples is what the quantized matmul multiplies by), the same mask ("causal", an
    array, or none) and scale. Looked up at call time, so `_shapes`' attention swaps
    (`few_queries`, `row_by_row`) apply to it as to a plain cache's."""
    k, k_scales, k_biases = q_keys
    v, v_scales, v_biases = q_values
    keys = mx.dequantize(k, k_scales, k_biases, group_size=group_size, bits=bits)
    values = mx.dequantize(v, v_scales, v_biases, group_size=group_size, bits=bits)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
