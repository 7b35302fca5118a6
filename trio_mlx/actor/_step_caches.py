"""The decoding batch's KV caches, made to launch less per step without computing otherwise.

mlx-lm's `BatchKVCache` (and `_kv_quant.BatchQuantizedKVCache`, in its layout) does per
layer, per step, work that a decode step needs once or not at all: it builds a causal
mask with the rows' left padding even where no row is padded, and each layer adds the
step's length to its own copy of the rows' offsets, an array kernel per layer. At one row
those launches are a visible share of a step whose forward is a few milliseconds
(BENCHMARKS.md, "The actor's decode step"). `unmask_unpadded` overrides the mask on the
cache instances, once per change of the batch's rows; `share_offsets` leaves one offset
array for every layer after each forward is built. The step's values are the same. Each
names the private attributes it relies on; tests/integration/test_mlx_lm_internals.py
pins them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from ._kv_quant import BatchQuantizedKVCache

# The batch caches the actor's helpers work on: plain KV, and quantized KV (`kv_bits`), whose
# keys and values are (data, scales, biases) triples in the same layout (`_kv_quant.py`).
BATCH_KV = (BatchKVCache, BatchQuantizedKVCache)


def _one_token_no_mask(cache: Any) -> Callable[..., Any]:
    """`cache.make_mask` without a mask at one token, and "causal" for several (what the
    left padding's array says where there is none). It holds the cache weakly: a strong
    reference from the cache's own attribute would make a cycle, which keeps the cache's KV
    alive after the batch drops it, until the cyclic collector happens to run."""
    ref: Callable[[], Any] = weakref.ref(cache)

    def make_mask(N: int, return_array: bool = False, **kwargs: Any) -> Any:
        if N == 1:
            return None
        if return_array or kwargs.get("window_size"):
            c = ref()  # a `BatchKVCache` or a `BatchQuantizedKVCache`: one mask
            return type(c).make_mask(c, N, return_array=return_array, **kwargs)
        return "causal"  # no row padded: several tokens (a speculative step) need only causality

    return make_mask


def aligned(caches: list[Any]) -> bool:
    """Whether `caches` (a batch's, one per layer) are all `BatchKVCache`s, or all
    `BatchQuantizedKVCache`s, at one position (`_idx`, a host int): they then share their
    padding and their offsets."""
    kind = type(caches[0]) if caches else None
    return kind in BATCH_KV and all(type(c) is kind and c._idx == caches[0]._idx for c in caches)


def share_offsets(caches: list[Any]) -> None:
    """Give every layer's cache the first layer's offset array, after a forward has been
    built and before it is evaluated: the additions each later layer built in its
    `update_and_fetch` (`self.offset = self.offset + n`) are dropped, never evaluated.

    mlx-lm's models advance every layer's cache by the same tokens from the same left
    padding, so the layers' offsets are equal: one array serves them all, as one layer's
    `_idx` and padding would. Only where every cache is of one batch kind and at one
    position (`aligned`): a model whose layers share or skip caches keeps its own.
    Done after the forward rather than inside `update_and_fetch`, so no cache carries an
    override that a shallow copy would share."""
    if not aligned(caches):
        return
    offset = caches[0].offset
    for c in caches:
        c.offset = offset


def unmask_unpadded(caches: list[Any]) -> bool:
    """Leave the attention mask out of a one-token step where no row of the batch is padded;
    returns whether none is (every row at one position, the rows in lockstep).

    `BatchKVCache.make_mask` builds a causal mask with the rows' left padding at every step,
    and attention with an array mask takes a slower path than with none. With no padding a
    one-token query may see every cached position, which is what no mask means, as a plain
    `KVCache` has none at one token. The padding is read back (a device round trip) only
    when its array is a new one, i.e. after rows entered or left (`extend`, `filter`,
    `prepare`, `finalize` each assign a new array); each layer's cache then has its
    `make_mask` overridden or restored. Caches of other kinds keep theirs."""
    first: Any = caches[0] if caches else None
    if type(first) not in BATCH_KV:
        return False
    padding = first.left_padding
    if vars(first).get("_trio_padding_seen") is padding:
        return "make_mask" in vars(first)  # as last read: overridden where unpadded
    unpadded = not bool(mx.any(padding > 0).item())
    for c in caches:
        if type(c) not in BATCH_KV:
            continue
        if unpadded:
            vars(c)["make_mask"] = _one_token_no_mask(c)
        else:
            vars(c).pop("make_mask", None)
    vars(first)["_trio_padding_seen"] = padding
    return unpadded
