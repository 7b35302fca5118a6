"""The shapes the actor's forwards run at, and why: the prefill chunk that bounds attention
scores, the prefill budget's chunks, the shape grid prefills run on under CUDA, and the
swaps of MLX's fused attention that keep cuDNN from building a graph for every shape it
meets (`few_queries` for a speculative step, `row_by_row` for a prefill of several
rows), and the one that gives a left-padded decode step one kernel (`few_queries` at one
query, `_cuda_attention.py`); and the output head taken at one position of a prompt's last
chunk (`one_position_head`). No mlx-lm here: `_batch.py`'s `CausalPrefill` applies them
to the model.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx

from . import _cuda_attention
from ._tuning import MAX_DRAFT

# The bytes one prefill step's attention scores may take. Where MLX has no fused kernel for
# a prefill's attention (its CUDA and CPU backends, with the padding mask a batched prefill
# carries), it materializes rows x heads x chunk x context scores: 8 prompts of 3-7.5k
# tokens in chunks of 2048 beside 64 decoding rows ran a GPU out of memory, and chunks
# of 512 served them all. A constant, not a share of the device's
# memory: every rank of a distributed group must cut its prompts alike.
ATTENTION_SCRATCH = 4 << 30
_CHUNK_ROUND = 128


def prefill_chunk(step: int, rows: int, context: int, heads: int, scratch: int | None = None) -> int:
    """The prefill chunk (tokens per prompt per step) for `rows` prompts of up to `context`
    tokens: `step`, cut so that float32 scores for `heads` heads fit `scratch` bytes
    (ATTENTION_SCRATCH); when cut, a power of two (few distinct shapes to compile, and
    on the shape grid: `CausalPrefill`), never under 128."""
    scratch = ATTENTION_SCRATCH if scratch is None else scratch
    if rows <= 0 or context <= 0 or heads <= 0:
        return step
    fit = scratch // (4 * rows * heads * context)
    if fit >= step:
        return step
    return min(step, max(_CHUNK_ROUND, 1 << (max(fit, 1).bit_length() - 1)))


def budget_chunk(step: int, left: list[int], budget: int, grid: bool = False) -> int:
    """The prefill chunk (tokens per prompt per step, at most `step`) that keeps one step's
    prompt tokens within `budget` for prompts with `left` tokens still to go: the largest
    such chunk on the rounding `prefill_chunk` uses (powers of two, never under 128), so a
    group whose prompts are short enough still goes whole, and only long ones are cut
    (as vLLM's chunked prefill fills a step's token budget). On the shape grid
    (`CausalPrefill`) multiples of GRID_PREFIX (512) instead, never under it: the chunks
    and the prefixes they leave behind stay shapes warm-up has built (a query of 512, 1,024,
    ... behind a multiple of 512). Where even the floor exceeds the budget (rows x 128 >
    budget), the floor: `budget` <= 0 is no budget."""
    if budget <= 0 or not left or sum(min(n, step) for n in left) <= budget:
        return step
    if grid:
        candidates = list(range(step // GRID_PREFIX * GRID_PREFIX, 0, -GRID_PREFIX)) or [step]
    else:
        candidates = [1 << k for k in range((step - 1).bit_length() - 1, _CHUNK_ROUND.bit_length() - 2, -1)]
        candidates = [c for c in candidates if c < step] or [min(step, _CHUNK_ROUND)]
    for c in candidates:
        if sum(min(n, c) for n in left) <= budget:
            return c
    return candidates[-1]


# On CUDA, where MLX builds a cuDNN attention graph for every new prefill shape (see
# `CausalPrefill`), an unpadded prefill step's query runs padded on the right to a power
# of two of at least GRID_MIN tokens, and above GRID_QUERY to a multiple of it; cached
# prefixes are cut to multiples of GRID_PREFIX, so that the shapes a server meets are few
# and recur; warm-up builds them for one row up to GRID_PREBUILD tokens of context
# (`_warmup.prebuild_prefill`), and a step of several rows runs its attention one row at a
# time, on those shapes. A prefix grain of 512 against 1,024: twice the shapes to build
# in warm-up (seconds more), for chat turns that cut one chunk fewer, which was faster at
# 8 conversations; a grain of 256 gained nothing more. A query grain of 512 above 512
# rather than powers of two: a chat turn's ~1,350 new tokens run as 1,536, not 2,048
# (25% fewer tokens through the MLP).
GRID_MIN = 128
GRID_QUERY = 512
GRID_PREFIX = 512
GRID_PREBUILD = 8192


def prefill_grid() -> bool:
    """Whether prefills run on the shape grid: on CUDA, whose fused attention builds a
    graph for every shape it meets (`CausalPrefill`); Metal's and the CPU's do not."""
    return mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()


def grid_length(n: int) -> int:
    """The query length an unpadded prefill step of `n` tokens runs at on the grid."""
    if n > GRID_QUERY:
        return -(-n // GRID_QUERY) * GRID_QUERY
    return max(GRID_MIN, 1 << (n - 1).bit_length())


def grid_sizes(step: int) -> list[int]:
    """Every query length on the grid up to a prefill step of `step` tokens."""
    out, n = [], GRID_MIN
    while n <= grid_length(step):
        out.append(n)
        n = 2 * n if n < GRID_QUERY else n + GRID_QUERY
    return out


# The most tokens a step behind a KV may feed for its attention to run as matmuls
# (`few_queries`), its scores materialized: a speculative step feeds a row's pending token
# and its drafts, as many as a tuning allows.
FEW_QUERIES = MAX_DRAFT + 1
# The most bytes those matmuls' scores (float32) may take; past them (a long context, many
# drafts, many rows) the queries attend in runs that fit, and where not even two fit, one
# at a time, materializing nothing: 8 rows of 32 heads verifying 33 tokens each reach it at
# ~32k tokens of context, one query at ~1M.
FEW_SCRATCH = 1 << 30


@contextlib.contextmanager
def _attending(attend: Callable[..., Any]) -> Iterator[None]:
    """MLX's fused attention swapped for `attend(sdpa, ...)` while it is open: mlx_lm's models
    call it through `models.base.scaled_dot_product_attention`, with no hook of their own.
    On the actor's thread, the only one that runs a model."""
    sdpa = mx.fast.scaled_dot_product_attention
    mx.fast.scaled_dot_product_attention = functools.partial(attend, sdpa)
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = sdpa


def row_by_row(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """While it is open (and `on`), a causal prefill of several rows attends one row at a
    time (`_row_attention`), on the one-row shapes warm-up builds (`_batch.CausalPrefill`)."""
    return _attending(_row_attention) if on else contextlib.nullcontext()


def few_queries(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """While it is open (and `on`), a few queries (2 to FEW_QUERIES) behind a KV attend
    through `attention` (matmuls, the mask applied, a softmax: what MLX's own attention
    computes where it has no fused kernel), not MLX's fused attention: the same result.

    On CUDA, MLX 0.32.4 takes the fused attention of several queries to cuDNN, which builds
    a graph for every pair of query and key lengths it meets (`CausalPrefill`), tens of ms
    each, with a causal mask and with an array one (on an H200: 68-112 and 70-1,350 ms),
    and a speculative step behind a KV one step longer than the last meets a new pair at
    nearly every step. The matmuls take kernels built for any length. On an H200 the
    verify step of four padded rows (1B shape) took ~9 ms so, against ~19 ms with each
    query attending alone through the fused kernel of one query (BENCHMARKS.md), which is
    what a step does where not even two queries' scores fit in FEW_SCRATCH (where some do,
    they attend as matmuls in runs of as many as fit).

    One query under an array mask (a decode step of left-padded rows) takes the kernel of
    `_cuda_attention.py` where it runs, in place of MLX's fallback, which materializes the
    scores in several kernels a layer."""
    return _attending(_few) if on else contextlib.nullcontext()


def _few(sdpa: Callable[..., Any], queries: Any, keys: Any, values: Any, *, scale: float,
         mask: Any = None, sinks: Any = None, **kwargs: Any) -> Any:
    b, h, n, _ = queries.shape
    if (n == 1 and sinks is None and not kwargs and _cuda_attention.available()
            and _cuda_attention.applies(queries, keys, values, mask)):
        return _cuda_attention.attention(queries, keys, values, scale, mask)
    total = keys.shape[2]
    causal = isinstance(mask, str) and mask == "causal"
    if not 1 < n <= FEW_QUERIES or sinks is not None or kwargs or not (causal or isinstance(mask, mx.array)):
        return sdpa(queries, keys, values, scale=scale, mask=mask, sinks=sinks, **kwargs)
    fit = FEW_SCRATCH // (b * h * total * 4)  # the queries whose scores fit at once
    if fit >= n:
        return attention(queries, keys, values, scale, _causal(n, total) if causal else mask)
    # In runs of as many queries as fit, each over the keys its last query may see; a run of
    # one through the fused attention of one query (a kernel built for any key length, the
    # scores never materialized, ~3x the matmuls' time on an H200).
    outs = []
    step = max(1, fit)
    for i in range(0, n, step):
        j = min(n, i + step)
        end = total - (n - j) if causal else total
        q, k, v = queries[:, :, i:j], keys[:, :, :end], values[:, :, :end]
        # the run's rows of an array mask (one row: the same for every query)
        m = None if causal else mask if mask.shape[-2] == 1 else mask[..., i:j, :]
        if j - i == 1:
            outs.append(sdpa(q, k, v, scale=scale, mask=m))
        else:
            outs.append(attention(q, k, v, scale, _causal(j - i, end) if causal else m))
    return mx.concatenate(outs, axis=2)


def attention(queries: Any, keys: Any, values: Any, scale: float, mask: Any) -> Any:
    """Scaled dot-product attention as MLX computes it without a fused kernel (its
    `fast.scaled_dot_product_attention` fallback): queries (B, H, N, D) over keys and
    values (B, H_kv, T, D), H a multiple of H_kv; `mask` an array broadcast against
    (B, H, N, T), boolean (True: attend) or added to the scores. The scores are
    materialized: for a few queries only."""
    b, h, n, d = queries.shape
    kv, total = keys.shape[1], keys.shape[2]
    group = h // kv
    scores = ((queries * scale).reshape(b, kv, group * n, d) @ keys.swapaxes(-1, -2)).reshape(b, kv, group, n, total)
    if mask.ndim == 4 and mask.shape[1] == h > 1:
        mask = mask.reshape(mask.shape[0], kv, group, n, total)
    elif mask.ndim >= 3:
        mask = mx.expand_dims(mask, -3)
    if mask.dtype == mx.bool_:
        scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
    else:
        scores = scores + mask.astype(scores.dtype)  # in the queries' type, as the fused attention keeps it
    weights = mx.softmax(scores, axis=-1, precise=True).reshape(b, kv, group * n, total)
    return (weights @ values).reshape(b, h, n, d)


@functools.lru_cache(maxsize=4)
def _causal(n: int, total: int) -> Any:
    """The causal mask of `n` queries at the end of `total` keys, as an array (every layer
    of a step asks for the same one)."""
    return mx.arange(total)[None] <= mx.arange(total - n, total)[:, None]


def _row_attention(sdpa: Callable[..., Any], queries: Any, keys: Any, values: Any, *, scale: float,
                   mask: Any = None, **kwargs: Any) -> Any:
    """`sdpa` (MLX's fused attention) one row at a time, for a causal prefill of several
    rows: the same result, on one-row shapes (what warm-up builds). Anything else goes
    through as one call."""
    if queries.shape[0] == 1 or queries.shape[2] == 1 or not (isinstance(mask, str) and mask == "causal"):
        return sdpa(queries, keys, values, scale=scale, mask=mask, **kwargs)
    return mx.concatenate([sdpa(queries[i : i + 1], keys[i : i + 1], values[i : i + 1], scale=scale, mask=mask,
                                **kwargs) for i in range(queries.shape[0])], axis=0)


@contextlib.contextmanager
def one_position_head(model: Any, index: int) -> Iterator[None]:
    """While it is open, `model`'s output head takes the hidden state at position `index`
    alone: the logits of that position, (B, 1, V), not of every position.

    mlx-lm's causal LMs end with `lm_head(h)`, or with tied embeddings
    `embed_tokens.as_linear(h)`, over every position, and MLX computes the whole matmul
    before any slice of its result: over a prompt's chunk, a head as wide as the vocabulary
    for each token, where only the last token's logits are wanted (`_batch._prompt_end`).
    Each module's `lm_head` and each embedding's `as_linear` are shadowed on the instance
    (its `__dict__`, which attribute lookup reads before the module's children); a model whose
    head goes by another name keeps it, and the caller sees every position come back."""
    shadowed: list[tuple[Any, str]] = []

    def sliced(head: Callable[[Any], Any]) -> Callable[[Any], Any]:  # (B, L, D) hidden states only
        return lambda h: head(h[:, index : index + 1] if h.ndim == 3 else h)

    for m in model.modules():
        if "lm_head" in m and "lm_head" not in vars(m):
            vars(m)["lm_head"] = sliced(m["lm_head"])
            shadowed.append((m, "lm_head"))
        if callable(getattr(type(m), "as_linear", None)) and "as_linear" not in vars(m):
            vars(m)["as_linear"] = sliced(functools.partial(type(m).as_linear, m))
            shadowed.append((m, "as_linear"))
    try:
        yield
    finally:
        for m, name in shadowed:
            vars(m).pop(name, None)
