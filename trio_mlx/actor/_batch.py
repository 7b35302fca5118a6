"""Every use of mlx-lm's BatchGenerator internals, in one place.

mlx-lm 0.32 offers no public way to do what the actor needs here: remove rows
without a host round trip per layer, read the decoding batch's row count for
the step trace, read and reset the prompt-token counter per step, read what
each prompt has left to prefill for the per-step budget (`prompts_left`), copy a
decoding row's KV out for the prompt cache without a host round trip per
layer (`copy_rows`), give a prefill without padding the fused attention, on
shapes that recur (`CausalPrefill`), read the first tokens of rows that have
just started decoding (`first_tokens`), or move KV at the device's copy rate
where mlx-lm gathers it (a removal's kept rows, `take_rows`; a right-padded
group's roll, `roll_right`; a finished group handed to decoding, `_split`), or
take the decode step over (`own_decode`: one forward over the decoding batch,
then the actor's own batched sampling, `_decode.Decoder`; a group whose prompts
end joins that forward, `_join`; a speculative step where rows have drafts is
`_spec_step.py`'s, with the helpers here; a group's prompts end in their prefill's last
forward into an empty batch, `_prompt_end`), or tell a model with named LoRA
adapters which adapter each row of a forward runs with (`adapter_rows`, around
every forward: the prompt batch's `prompt`, the owned step, the speculative verify).
Each helper names the private attribute it
relies on; tests/integration/test_mlx_lm_internals.py pins each behaviour, so an mlx-lm
upgrade that changes one fails there first.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
import weakref
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache, KVCache, dynamic_roll, make_prompt_cache

from ._decode import Decoder, DecodeRow
from ._kv_quant import RowQuantizedKVCache, kv_arrays, kv_map
from ._row_adapters import RowAdapters, selected
from ._shapes import (
    few_queries,
    grid_length,
    one_position_head,
    prefill_chunk,
    row_by_row,
)
from ._step_caches import BATCH_KV, aligned, share_offsets, unmask_unpadded


def batch_rows(bg: Any) -> int:
    """The decoding batch's rows (`bg._generation_batch`); 0 when nothing decodes."""
    return len(getattr(bg, "_generation_batch", ()) or ())


# The most rows that may decode beside rows starting now for their first tokens to be read
# at once (`first_tokens`, `Actor._first_tokens`). Reading waits for the device, so every row
# loses the overlap of one step with building the next (a fraction of a step); each starting
# row gets its first token a whole step sooner. In a narrow batch arrivals are few per step,
# and the step is the short one; in a wide one they come every few steps, and the overlap of
# each would be lost for every row.
EARLY_FIRST_BESIDE = 7


def first_tokens(bg: Any, uids: list[int]) -> Any:
    """The first tokens of rows that have just started decoding (uids in `uids`), as the
    generator will report them at its next step: `GenerationBatch.Response`s, or where the
    actor owns the decode step (`own_decode`) a `Decoded`.

    The step that ends a prompt (its last token through the model) samples the first
    token and leaves it computing (`GenerationBatch._next_tokens`); mlx_lm reports it
    only at the next step, once that step's graph is built. Read here, it waits for the
    device now (`tolist`) and so gives up the overlap of that computation with the next
    step's graph building, for every row of the batch."""
    batch = bg._generation_batch
    index = {uid: i for i, uid in enumerate(batch.uids)}
    rows = [(uid, index[uid]) for uid in uids if uid in index]
    if not rows:
        return []
    tokens = batch._next_tokens.tolist()
    if "_step" in vars(batch):  # the actor's own step: logprobs wait on each row (`DecodeRow.pending`)
        owned = [batch.samplers[i] for _, i in rows]
        vars(bg._prompt_batch)["_decoder"].read_ahead(owned)
        return Decoded([uid for uid, _ in rows], [tokens[i] for _, i in rows], owned)
    response = type(batch).Response
    return [response(uid, tokens[i], batch._next_logprobs[i], None, None, None) for uid, i in rows]


def take_prompt_tokens(bg: Any) -> int:
    """Prompt tokens the generator processed since the last call (`bg._counters`), reset to 0."""
    stats = bg._counters
    n = stats.prompt_tokens
    stats.prompt_tokens = 0
    return int(n)


def peek_prompt_tokens(bg: Any) -> int:
    """Prompt tokens the generator has counted so far, without resetting them."""
    return int(bg._counters.prompt_tokens)


def remove_rows(bg: Any, uids: list[int]) -> None:
    """`bg.remove(uids)`, with one read of the decoding batch's padding instead of one per layer.

    mlx_lm's `BatchKVCache.filter` reads the kept rows' left padding back to
    the host (`tolist()`) in every layer, to trim the padding all rows share:
    a GPU round trip per layer, which made removals a few percent of a busy
    server's time. Every layer of a batch is filtered, extended and padded
    alike, so all hold the same padding: here the first layer's is read once
    and every layer filters with it, as the stock `filter` would, with the
    same tokens (a removal 5-9x cheaper on a GPU). The kept rows are copied
    as slices (`take_rows`), not gathered. A batch whose
    caches are not all `BatchKVCache`s (or all `BatchQuantizedKVCache`s) at one
    position keeps the stock path.
    """
    caches = _kv_caches(getattr(bg, "_generation_batch", None))
    if caches is None:
        bg.remove(uids)
        return
    _keeping(caches, _KeepRows(caches[0].left_padding.tolist()), bg.remove, uids)


def _keeping(caches: list[Any], keep: _KeepRows, call: Callable[..., Any], *args: Any) -> Any:
    """`call(*args)` with each of `caches` filtering through `keep` rather than the stock
    `BatchKVCache.filter`: mlx-lm's own batch methods do the rest (its row lists)."""
    for c in caches:
        vars(c)["filter"] = functools.partial(keep, c)  # shadows the class's filter for this call only
    try:
        return call(*args)
    finally:
        for c in caches:
            vars(c).pop("filter", None)


def _kv_caches(batch: Any) -> list[Any] | None:
    """A batch's per-layer caches (the decoding batch's or the prompt batch's) if all are
    `BatchKVCache`s, or all `BatchQuantizedKVCache`s, at one position (so they share their
    padding), else None."""
    caches = list(getattr(batch, "prompt_cache", None) or ())
    return caches if aligned(caches) else None


class _KeepRows:
    """`BatchKVCache.filter` with the rows' left padding known on the host: the same
    arrays as the stock method, without reading the padding back."""

    __slots__ = ("padding",)

    def __init__(self, padding: list[int]):
        self.padding = padding

    def __call__(self, c: Any, batch_indices: list[int]) -> None:
        kept = [self.padding[i] for i in batch_indices]
        shift = min(kept)
        rows = mx.array(batch_indices)
        if c.keys is not None:
            c.keys = kv_map(lambda a: take_rows(a, batch_indices), c.keys)
            c.values = kv_map(lambda a: take_rows(a, batch_indices), c.values)
        c.offset = c.offset[rows]
        c.left_padding = mx.array([p - shift for p in kept])
        if shift > 0:
            if c.keys is not None:
                c.keys, c.values = kv_map(lambda a: a[..., shift:, :], c.keys), kv_map(lambda a: a[..., shift:, :], c.values)
            c._idx -= shift



def take_rows(a: Any, rows: list[int]) -> Any:
    """`a[mx.array(rows)]` (rows along the first axis, in that order), as slices.

    MLX 0.32's gather moves a KV buffer's rows several times slower than a plain
    copy on a GPU (3-5x on the removals a batch makes). A batch keeps its
    rows in order and drops a few, so the kept rows are a few runs of neighbours:
    one slice each, joined by one concatenation. A single run needs no copy, and
    MLX may keep it a view of the old buffer until the batch's next copy (the
    next group's arrival, or the buffer's growth)."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    if len(runs) == 1:
        return mx.contiguous(a[runs[0][0] : runs[0][1]]) if runs[0] != (0, a.shape[0]) else a
    return mx.concatenate([a[i:j] for i, j in runs], axis=0)


def roll_right(a: Any, shifts: list[int]) -> Any:
    """mlx_lm's `dynamic_roll(a, mx.array(shifts)[:, None], axis=2)` (each row rolled right by
    its shift along the tokens), with the shifts known on the host.

    `dynamic_roll` gathers element by element, far below a copy's bandwidth: the
    roll that ends a group prefill of long chat follow-ups whose new tokens differ
    in length (`BatchKVCache.finalize`) took ~10x as long as slices joined by
    concatenation. But each shifted row costs a few kernel launches, so for many
    short rows the gather is the faster (2.5x at 256 rows of 256 tokens). So rows whose slab
    (one layer's keys or values) holds ROLL_SLICE_BYTES or more roll as slices, and
    smaller ones (a group of short fresh prompts) as the gather."""
    if a.shape[1] * a.shape[2] * a.shape[3] * a.itemsize < ROLL_SLICE_BYTES:
        return dynamic_roll(a, mx.array(shifts)[:, None], axis=2)
    n = a.shape[2]
    parts, start = [], 0
    for i, s in enumerate(shifts):
        s %= n
        if not s:
            continue
        if start < i:
            parts.append(a[start:i])
        row = a[i : i + 1]
        parts.append(mx.concatenate([row[:, :, n - s :], row[:, :, : n - s]], axis=2))
        start = i + 1
    if not parts:
        return a
    if start < a.shape[0]:
        parts.append(a[start:])
    return mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


# A row's slab from which slices roll faster than the gather: on an H100 a shifted row
# as slices cost ~30 us of launches per array, the gather ~20 us per MB (~50 GB/s)
ROLL_SLICE_BYTES = 1 << 20


def move_whole_groups(bg: Any) -> None:
    """Give `bg`'s prompt batch (`bg._prompt_batch`, one object for the generator's life) a
    `split` that hands the rows whose prompts ended to the decoding batch without
    deep-copying the batch's KV (`_split`)."""
    batch = bg._prompt_batch
    vars(batch)["split"] = functools.partial(_split, batch)


def _split(batch: Any, indices: list[int]) -> Any:
    """`_split_rows`, and where the actor owns the decode step (`own_decode`), the rows'
    first step taken by it too (`_owned_generate`)."""
    out = _split_rows(batch, indices)
    decoder = vars(batch).get("_decoder")
    if decoder is not None:
        vars(out)["generate"] = functools.partial(_owned_generate, decoder, out)
    return out


def _split_rows(batch: Any, indices: list[int]) -> Any:
    """`PromptProcessingBatch.split(indices)`: the rows in `indices` as a batch of their own,
    the rest left, with the same arrays as the stock method.

    The stock method deep-copies every layer's KV, then gathers each side's rows
    (`BatchKVCache.filter`, with one host read per layer): for a group of 7 chat
    follow-ups of 7,500 tokens, 1.7 GB copied and then gathered twice, in the step
    that brings them their first tokens. Where `indices` are every row (a group whose
    prompts end together, the usual case), the batch's caches move to the new batch
    and it is left empty: no copy at all. Where they are some (prompts ending in
    different steps, long ones chunked), each side keeps its rows as slices
    (`_KeepRows`, one read of the padding): a copy of each row, once. Either way
    mlx-lm's own `filter` splits the batch's per-row lists."""
    cls: Any = type(batch)
    rows = sorted(indices)
    whole = rows == list(range(len(batch.uids)))
    caches = None if whole else _kv_caches(batch)
    if not whole and (caches is None or any(c.keys is None or c._right_padding is not None for c in caches)):
        return cls.split(batch, indices)  # the stock method, past this instance's override
    moved = copy.copy(batch)  # its lists are replaced, not changed, by `filter`
    for name in ("split", "generate", "_decoder", "prompt"):
        vars(moved).pop(name, None)
    if whole:
        batch.prompt_cache = []  # the caches go as they are (`filter([])` clears the list it holds)
        cls.filter(batch, [])
        return moved
    assert caches is not None
    keep = _KeepRows(caches[0].left_padding.tolist())
    moved.prompt_cache = [copy.copy(c) for c in caches]  # shallow: `keep` replaces their arrays
    _keeping(moved.prompt_cache, keep, cls.filter, moved, rows)
    _keeping(caches, keep, cls.filter, batch, sorted(set(range(len(batch.uids))) - set(rows)))
    return moved


class Speculated:
    """A speculative step's outcome for its row (`_spec_step.speculative_step`): the drafted tokens
    the target kept (reported after the row's token in `Decoded.tokens`, in order), their
    logprobs where the row asks (`outs`), and how many were drafted."""

    __slots__ = ("tokens", "outs", "drafted")

    def __init__(self, tokens: list[int], outs: list[Any], drafted: int):
        self.tokens, self.outs, self.drafted = tokens, outs, drafted


class Decoded:
    """One owned decode step's report (`own_decode`): the rows' uids, the tokens reported
    this step (each row's input to the step's forward), and the rows' `DecodeRow`s, whose
    `out` holds the logprobs of those tokens for the rows that asked; `spec`, where the
    step was a speculative one, each row's `Speculated` (None for a row that did not). Its
    length is the tokens' count, as mlx_lm's list of responses counts them."""

    __slots__ = ("uids", "tokens", "rows", "spec")

    def __init__(self, uids: list[int], tokens: list[int], rows: list[DecodeRow],
                 spec: list[Speculated | None] | None = None):
        self.uids, self.tokens, self.rows, self.spec = uids, tokens, rows, spec

    def __len__(self) -> int:
        return len(self.tokens)


def own_decode(bg: Any, decoder: Decoder) -> None:
    """Make the actor's decode step `bg`'s: one forward over the decoding batch, then
    `decoder`'s batched processing and sampling, for every row from its first token on.

    mlx_lm's `GenerationBatch._step` runs each row's sampler and logits processors in a
    Python loop and splits the log-probabilities into one array per row; its `next` builds
    a `Response` per row and ends rows by itself. Here the decoding batch
    (`bg._generation_batch`, one object for the generator's life: rows come and go by
    its `extend` and `filter`) steps through `_owned_step` and reports a `Decoded`
    (`_owned_next`), and never ends a row: the actor retires them. A group whose prompts
    end gets its first step from the decoder too (`_owned_generate`, set by `_split` on the
    batch it hands over), into an empty batch from its prefill's last forward (`_prompt_end`).
    Every row must be inserted with a `DecodeRow` as its sampler and
    no logits processors. Needs `move_whole_groups(bg)` first. mlx_lm's KV caches, its
    prefill, `remove`, `insert` and the helpers here work as they did: the batch keeps its
    per-row lists (`uids`, `tokens`, `samplers`, ...) and `_next_tokens` as mlx_lm would.
    """
    assert "split" in vars(bg._prompt_batch), "move_whole_groups first"
    vars(bg._prompt_batch)["_decoder"] = decoder
    batch = bg._generation_batch
    # The overrides hold the batch weakly: held strongly from its own attributes, a dropped
    # generator's batch (a reset after a failed step) would keep its KV until the cyclic
    # collector ran (as `unmask_unpadded` says of the caches).
    ref = weakref.proxy(batch)
    vars(batch)["_step"] = functools.partial(_owned_step, decoder, ref, False)
    vars(batch)["next"] = functools.partial(_owned_next, decoder, ref, weakref.proxy(bg))
    select_adapters(bg)  # its `prompt` also ends a lone group's prompts in their last chunk (`_prompt_end`)


def owns_decode(bg: Any) -> bool:
    """Whether `own_decode` took `bg`'s decode step over."""
    return "_step" in vars(bg._generation_batch)


def _owned_step(decoder: Decoder, batch: Any, first: bool, logits: Any = None) -> tuple[list[int], list[Any]]:
    """`GenerationBatch._step` with the actor's sampling: forward the tokens sampled last
    step (`_next_tokens`, still computing), sample the next ones, start them, then read the
    fed tokens back and append them to `tokens` (the ids each row's KV holds). With
    `logits`, the rows' prompts' last tokens went through their prefill's forward, into
    their KV and `tokens` (`_prompt_end`): those logits are sampled, nothing is fed."""
    inputs = batch._next_tokens
    batch._current_tokens = inputs
    batch._current_logprobs = batch._next_logprobs
    fed_before = logits is not None
    if logits is None:
        unmask_unpadded(batch.prompt_cache)
        with adapter_rows(batch.model, batch.uids):
            logits = batch.model(inputs[:, None], cache=batch.prompt_cache)[:, -1, :]
        share_offsets(batch.prompt_cache)
    # None, or the masks filling while `step` has MLX encode the forward just built
    early = decoder.masks_first(batch.samplers, inputs, first)
    sampled, fed = decoder.step(logits, batch.samplers, inputs, first, early)
    batch._next_tokens = sampled
    batch._next_logprobs = [None] * len(fed)  # kept row-aligned: `filter` and `extend` index it
    if not fed_before:
        for held, t in zip(batch.tokens, fed, strict=True):
            held.append(t)
    return fed, batch._current_logprobs


def first_token_waits(bg: Any, batch: Any) -> bool:
    """Whether a sequence of `bg` waits for its first token: a prompt inserted and not yet
    through its prefill (`bg._unprocessed_sequences`, `bg._prompt_batch`), or a row of
    `batch`, `bg`'s decoding batch, whose pending token is its first (sampled by the step
    that ended its prompt, reported with the next step: its KV holds its prompt alone)."""
    if bg._unprocessed_sequences or len(bg._prompt_batch):
        return True
    return any(len(held) <= len(row.prompt) for row, held in zip(batch.samplers, batch.tokens, strict=True))


def _owned_next(decoder: Decoder, batch: Any, bg: Any) -> Decoded:
    """`GenerationBatch.next`: one owned step; no row ends here (the actor retires them). With
    a drafter, a speculative step instead where rows have drafts (`_spec_step.py`), unless a
    sequence waits for its first token (`first_token_waits`): a speculative step takes longer
    than a plain one and is not pipelined, and each step until that token is out adds to
    its wait (the step that prefills it, the one that samples it, the one that reports it)."""
    if not batch.uids:
        return Decoded([], [], [])
    drafter = decoder.drafter
    timed = drafter is not None and len(batch.uids) <= drafter.max_rows  # a width that may speculate
    # `timed` first: a batch wider than `max_rows` never speculates, so its rows are not walked
    if timed and drafter.step is not None and not first_token_waits(bg, batch):
        spec = drafter.step(decoder, batch)  # `_spec_step.speculative_step`
        if spec is not None:
            return spec
    joined = _join(decoder, batch, bg) if len(bg._prompt_batch) else 0
    t0 = time.perf_counter()
    fed, _ = batch._step()
    if timed and not decoder.speculated_last and not joined:
        # pipelined: a step's wall time here is the device's step time (the first plain step
        # after a speculative one found nothing in flight, so it is not counted)
        decoder.timed_plain(len(batch.uids), time.perf_counter() - t0)
    decoder.speculated_last = False
    # copies: a group joining in this same `BatchGenerator.next` extends the batch's lists
    n = len(fed) - joined  # the rows joined last: what they were fed is their prompt's
    for row in batch.samplers[n:]:
        row.fresh = False
    return Decoded(batch.uids[:n], fed[:n], batch.samplers[:n])


def _join(decoder: Decoder, batch: Any, bg: Any) -> int:
    """Move the prompt batch's rows that have only their prompt's last token left into the
    decoding `batch` before its step, which feeds them that token beside every other row's
    (`DecodeRow.fresh`); returns how many joined, at the end of `batch`. mlx_lm's `_next`
    steps the decoding rows and then gives such a group a first step of its own
    (`generate`, `_owned_generate`): two forwards, where this is one, for the same first
    tokens."""
    split = [i for i, seq in enumerate(bg._currently_processing) if len(seq[0]) == 1 and len(seq[0][0]) == 1]
    if split:
        _start_decoding(decoder, bg, split, batch, step=False)
    return len(split)


def _start_decoding(decoder: Decoder, bg: Any, rows: list[int], into: Any, step: bool = True,
                    logits: Any = None) -> None:
    """Move the prompt batch's `rows` (indices into `bg._currently_processing`, each with only
    its prompt's last token left) into the decoding batch `into`, through `_owned_generate`
    (`step`, `logits`). Their prompt responses, as `_next` would have made them (the rows'
    segments and progress), wait in `bg` for `next_step`."""
    processing = bg._currently_processing
    last = [processing[i][0][0] for i in rows]
    progress = [(processing[i][2],) * 2 for i in rows]
    bg._currently_processing = [seq for i, seq in enumerate(processing) if i not in rows]
    gen = _owned_generate(decoder, bg._prompt_batch.split(rows), last, step=step, logits=logits)
    response = type(bg._prompt_batch).Response
    joined = vars(bg).setdefault("_trio_joined", [])
    joined += [response(uid, p, True, True) for uid, p in zip(gen.uids, progress, strict=True)]
    into.extend(gen)


def next_step(bg: Any) -> tuple[list[Any], Any]:
    """`bg.next()`: (prompt responses, generation responses), with those of the rows that
    joined the decoding step (`_join`) first."""
    vars(bg).pop("_trio_joined", None)  # left by a `bg.next()` of warm-up's: its rows are gone
    prompt, generated = bg.next()
    if joined := vars(bg).pop("_trio_joined", None):
        prompt = joined + prompt
    return prompt, generated


def _owned_generate(decoder: Decoder, batch: Any, tokens: list[list[int]], step: bool = True,
                    logits: Any = None) -> Any:
    """`PromptProcessingBatch.generate(tokens)` (what is left of each prompt; its last token
    starts decoding) with the first step taken by the decoder, not by mlx_lm's own
    `GenerationBatch.__init__`: the batch is built empty and given its rows after. Without
    `step`, the rows are left `fresh`, their last tokens pending, for a step to come. With
    `logits`, the last tokens are in the KV already and their logits are sampled
    (`_prompt_end`)."""
    if any(len(t) > 1 for t in tokens):
        with adapter_rows(batch.model, batch.uids):
            batch.prompt([t[:-1] for t in tokens])
    n = len(tokens)
    gen: Any = GenerationBatch(batch.model, [], mx.array([], dtype=mx.uint32), [], [], [], batch.fallback_sampler,
                          [], [], [])
    gen.uids, gen.prompt_cache, gen.tokens = batch.uids, batch.prompt_cache, batch.tokens
    gen.samplers, gen.logits_processors = batch.samplers, batch.logits_processors
    gen.stop_sequences, gen.max_tokens = batch.stop_sequences, batch.max_tokens
    gen._next_tokens = mx.array([t[-1] for t in tokens])
    gen._next_logprobs = [None] * n
    gen._token_context = [None] * n  # mlx_lm's processors' contexts: none here
    gen._num_tokens = [0] * n
    gen._matchers = [ss.matcher() for ss in gen.stop_sequences]
    batch.uids, batch.prompt_cache, batch.tokens = [], [], []  # as the stock method leaves it
    batch.samplers, batch.logits_processors, batch.max_tokens = [], [], []
    if step or logits is not None:
        _owned_step(decoder, gen, True, logits)
    else:
        for row in gen.samplers:
            row.fresh = True
    return gen


def adapter_rows(model: Any, uids: list[int]) -> Any:
    """A context in which `model`'s forward runs each row of `uids` with its adapter; nothing
    to do for a model without named adapters (or one not wrapped in `CausalPrefill`)."""
    adapters = getattr(model, "adapters", None) if type(model) is CausalPrefill else None
    return contextlib.nullcontext() if adapters is None else selected(adapters, uids)


def select_adapters(bg: Any) -> None:
    """Give `bg`'s prompt batch (one object for the generator's life) a `prompt` that runs
    each row's prefill with its adapter (`adapter_rows`), and where the actor owns the
    decode step ends a group's prompts in their last chunk when it can (`_prompt_end`).
    Needs `move_whole_groups(bg)` first: the batches it splits off drop this override and
    go through `_owned_generate`, which selects for them."""
    batch = bg._prompt_batch
    vars(batch)["prompt"] = functools.partial(_prompt, type(batch), weakref.proxy(batch), weakref.proxy(bg))


def _prompt(cls: Any, batch: Any, bg: Any, tokens: list[list[int]]) -> None:
    with adapter_rows(batch.model, batch.uids):
        if not _prompt_end(batch, bg, tokens):
            cls.prompt(batch, tokens)


def _prompt_end(batch: Any, bg: Any, tokens: list[list[int]]) -> bool:
    """`PromptProcessingBatch.prompt(tokens)` for a prompt batch whose every row has only
    its prompt's last token left after `tokens` (`bg._currently_processing`), into an empty
    decoding batch: the last tokens go into the same forward, its logits at their position
    are sampled for the rows' first tokens, and the rows move to the decoding batch now
    (`_start_decoding`, as `_join`'s do). mlx_lm keeps a prompt's last token for a forward
    of its own at the next `next()` (`generate`), a whole forward more on the way to the
    first token (BENCHMARKS.md, "What limits performance now"). Returns False, having done
    nothing, where it does not apply: the actor's decode step not owned, rows decoding, a
    row with more than its last token left, chunks of different lengths (right padding) or
    past `prefill_step_size` with the last token, caches left-padded or of another kind, or
    a model whose head could not be taken at one position (`CausalPrefill.one_head`)."""
    decoder, model = vars(batch).get("_decoder"), batch.model
    processing = bg._currently_processing
    if (decoder is None or len(bg._generation_batch) or type(model) is not CausalPrefill or not model.one_head
            or not tokens or len(processing) != len(tokens)):
        return False
    lasts: list[Any] = [seq[0][0] if len(seq[0]) == 1 and len(seq[0][0]) == 1 else None for seq in processing]
    n, caches = len(tokens[0]), _kv_caches(batch)
    if (None in lasts or any(len(t) != n for t in tokens) or n + 1 > batch.prefill_step_size or caches is None
            or any(_host_list(caches[0].left_padding))):
        return False
    full = [t + last for t, last in zip(tokens, lasts, strict=True)]  # each `last` a segment of one token
    for held, t in zip(batch.tokens, full, strict=True):
        held += t
    logits = model.last_logits(mx.array(full), batch.prompt_cache)
    _start_decoding(decoder, bg, list(range(len(full))), bg._generation_batch, logits=logits)
    return True


def _finalize(c: Any) -> None:
    """`BatchKVCache.finalize` (right padding rolled into left padding), rolling with
    `roll_right`: the same arrays. Set on a prompt batch's caches by `CausalPrefill`
    while they hold right padding, and gone once run."""
    vars(c).pop("finalize", None)
    if c._right_padding is None:
        return
    shifts = [int(s) for s in c._right_padding.tolist()]
    if c.keys is not None:
        c.keys = kv_map(lambda a: roll_right(a, shifts), c.keys)
        c.values = kv_map(lambda a: roll_right(a, shifts), c.values)
    c.offset = c.offset - c._right_padding
    c.left_padding = c.left_padding + c._right_padding
    c._right_padding = None


def plain_kv(model: Any) -> bool:
    """Whether the model's cache is a plain `KVCache` per layer: the only kind the prompt
    cache stores (`copy_rows` relies on its layout; rotating and state-space caches
    cannot be cut back to a prefix)."""
    return all(type(c) is KVCache for c in make_prompt_cache(model))


def copy_rows(bg: Any, lengths: dict[int, int]) -> dict[int, tuple[list[Any], list[int]]]:
    """Copies of decoding rows' KV: for each uid in `lengths` found in the decoding batch,
    one `KVCache` per layer holding the row's first `n` tokens, and the token ids they
    hold (`(caches, tokens)`), started at once (`async_eval`).

    mlx_lm's `BatchGenerator.extract_cache` (and `BatchKVCache.extract`) reads the
    batch's left padding back to the host in every layer. It needs none: a
    `BatchKVCache` keeps its rows right-aligned at `_idx` (left padding, with right
    padding rolled away in `finalize`), and the decoding batch's `tokens[i]` lists the
    ids whose KV row i holds (`GenerationBatch._step` appends each input as it is
    fed), so row i's content is `[_idx - len(tokens[i]), _idx)`.
    """
    batch: Any = getattr(bg, "_generation_batch", None)
    caches = list(getattr(batch, "prompt_cache", None) or ())
    if not lengths or not caches or any(type(c) not in BATCH_KV or c.keys is None for c in caches):
        return {}
    out: dict[int, tuple[list[Any], list[int]]] = {}
    arrays: list[Any] = []
    with mx.stream(bg.stream):
        for i, uid in enumerate(batch.uids):
            n = lengths.get(uid)
            if n is None:
                continue
            held = batch.tokens[i]
            n = min(n, len(held))
            if n <= 0:
                continue
            layers = []
            for c in caches:
                start = c._idx - len(held)
                kv = KVCache() if type(c) is BatchKVCache else RowQuantizedKVCache(c.group_size, c.bits)
                kv.keys, kv.values = _row_slice(c.keys, i, start, n), _row_slice(c.values, i, start, n)
                kv.offset = n
                layers.append(kv)
            arrays += [a for kv in layers for a in (*kv_arrays(kv.keys), *kv_arrays(kv.values))]
            out[uid] = (layers, list(held[:n]))
        if arrays:
            mx.async_eval(arrays)  # now, so that the batch's buffers are not held past the next step
    return out


def _row_slice(kv: Any, row: int, start: int, n: int) -> Any:
    """A contiguous copy of `n` tokens from `start` of one row of a batch cache's keys (or values)."""
    return kv_map(lambda a: mx.contiguous(a[row : row + 1, :, start : start + n]), kv)


def prompts_left(bg: Any) -> list[int]:
    """Prompt tokens each prompt still to prefill has left to go through a prefill step: the
    rows of the prompt batch (`bg._currently_processing`: each one's segments still to
    process) and those inserted but not yet in it (`bg._unprocessed_sequences`). A
    prompt's last token is not counted: it goes through the model with the decode step
    that brings its first token (`insert` makes it a segment of its own; `_next` hands a row
    whose segments are down to that one to `generate`)."""
    segments = [seq[0] for seq in bg._currently_processing] + [seq[1] for seq in bg._unprocessed_sequences]
    return [n for n in (sum(len(s) for s in segs) - 1 for segs in segments) if n > 0]


def set_prefill_chunk(bg: Any, tokens: int) -> None:
    """Cut the prompts `bg` prefills next into chunks of `tokens` (`bg.prefill_step_size`,
    read at every step; the prompt batch's own chunking, at the configured step, only
    splits what is longer)."""
    bg.prefill_step_size = tokens


class CausalPrefill:
    """The model as the BatchGenerator calls it: a prefill step whose rows carry no left
    padding gets `mask="causal"` instead of the array mask mlx_lm builds.

    `BatchKVCache.make_mask` always returns an array (the rows' left padding), and
    MLX 0.32's CUDA backend has no fused attention for a prefill with an array mask: it
    materializes the scores. With no left padding the causal mask is the same mask
    (right padding needs none: pads come after every real token), and "causal" takes
    the fused kernel, with the same logits, several times faster behind a long cached
    prefix. A group without left padding is every group of
    fresh prompts and every group whose cached prefixes are evened out
    (`_reuse.Reuse.even`). Decode steps (one token a row) are left as they are.

    With `grid` (on CUDA), such a step also runs on the shape grid: its tokens padded on
    the right to `grid_length` (the padding's KV trimmed off again after; a prefill
    step's logits are never read), and its keys and values handed to the attention as
    contiguous arrays. MLX 0.32.4 builds a cuDNN graph for every prefill attention it
    meets, keyed by the query's and keys' shapes and strides, at tens of ms each time
    against well under one ms for a shape met before. Every chat turn has lengths of its
    own, so each would pay that build. Keys sliced out of a KV buffer carry the buffer's length in their strides,
    which depends on the cache's history; a contiguous copy's strides follow its shape
    alone, so a shape built once (in warm-up) is found again. Warm-up builds one row's
    shapes; a step of several rows (a group of follow-ups entering together) would meet
    a new graph for each row count, so its attention runs one row at a time on those:
    MLX's fused attention is swapped, while the forward runs, for the same function per
    row (`_shapes.row_by_row`). A group of
    follow-ups at lengths met the first time then reaches its first tokens sooner, and
    at lengths met before no later.

    On the grid a step that takes the fused attention materializes no scores, so the
    actor leaves its chunk whole (`prefill_chunk` bounds materialized scores); a step
    with left padding (a prompt joining one whose prefill is under way) does, and is
    run here in chunks that `prefill_chunk` allows for `heads`. At 8 chat conversations
    on an H100, a group of 7 follow-ups behind 6k cached tokens was cut to chunks of
    512 and took 4 steps (45-50 ms each, then 119) to prefill; whole, one of 150-178 ms.

    A prompt batch whose prompts differ in length prefills right-padded, and mlx_lm's
    `BatchKVCache.finalize` then rolls the padding to the left with a gather; the
    caches such a step is called with get a `finalize` of their own for that roll
    (`_finalize`, with `roll_right`: the same arrays), gone once it has run.

    `built`, if given, is called as each forward returns: the step's graph is built, and
    what is left of the step waits on the device (`_link.ThreadLink`).

    `kv`, if given, is `(group_size, bits)` (`kv_bits`): every sequence the generator takes
    in gets a quantized cache per layer (`make_cache`; the model's own are plain `KVCache`s,
    which `Actor._load` checks), and its batches a `BatchQuantizedKVCache`
    (`_kv_quant.py`). Those steps keep mlx_lm's own mask: its quantized attention has no
    fused kernel to take.
    """

    __slots__ = ("_model", "grid", "_built", "_heads", "kv", "adapters", "one_head")

    def __init__(self, model: Any, grid: bool = False, built: Callable[[], None] | None = None,
                 heads: int = 0, kv: tuple[int, int] | None = None, adapters: RowAdapters | None = None):
        self._model = model
        self.grid = grid
        self._built = built
        self._heads = heads
        self.kv = kv
        self.adapters = adapters  # a model with named LoRA adapters: each row's (`adapter_rows`)
        self.one_head = True  # False once the output head could not be taken at one position

    def __getattr__(self, name: str) -> Any:  # the BatchGenerator reads `layers`
        return getattr(self._model, name)

    def make_cache(self) -> list[Any]:
        """A new sequence's caches, as `BatchGenerator.insert` makes them (`make_prompt_cache`
        asks the model for them when it has this method)."""
        caches = make_prompt_cache(self._model)
        if self.kv is None:
            return caches
        group_size, bits = self.kv
        return [RowQuantizedKVCache(group_size, bits) for _ in caches]

    def __call__(self, inputs: Any, cache: Any = None, **kwargs: Any) -> Any:
        if inputs.shape[1] > 1:  # right padding comes only with a prompt of 2 tokens or more
            for c in cache or ():
                if type(c) in BATCH_KV and c._right_padding is not None and "finalize" not in vars(c):
                    vars(c)["finalize"] = functools.partial(_finalize, c)  # the prompt batch rolls after
        out = self._forward(inputs, cache, **kwargs)
        if self._built is not None:
            self._built()
        return out

    def last_logits(self, inputs: Any, cache: Any) -> Any:
        """The forward of `inputs` with the output head taken at their last position alone
        (`_shapes.one_position_head`): its logits, (B, V). A model whose head goes by
        another name computes every position's: the last one's are returned, and `one_head`
        says so for the next time (`_prompt_end` then leaves the last token to mlx_lm)."""
        with one_position_head(self._model, inputs.shape[1] - 1):
            out = self(inputs, cache=cache)
        self.one_head = out.shape[1] == 1
        return out[:, -1, :]

    def verify(self, inputs: Any, cache: Any) -> Any:
        """The forward of a speculative step (`_spec_step.speculative_step`): each decoding
        row's pending token and its drafts (or fillers), a few tokens behind its KV, with
        mlx_lm's own mask (the rows' left padding, if any): none of the prefill's grid or
        chunking applies; on CUDA its attention runs as matmuls (`few_queries`)."""
        with few_queries(self.grid):
            out = self._model(inputs, cache=cache)
        if self._built is not None:
            self._built()
        return out

    def _forward(self, inputs: Any, cache: Any, **kwargs: Any) -> Any:
        first: Any = cache[0] if cache else None
        if inputs.shape[1] == 1:  # a decode step: with rows left-padded, one kernel (`few_queries`)
            with few_queries(self.grid):
                return self._model(inputs, cache=cache, **kwargs)
        if type(first) is not BatchKVCache:
            return self._model(inputs, cache=cache, **kwargs)
        if any(_host_list(first.left_padding)):
            return self._padded(inputs, cache, **kwargs)
        grid = self.grid and all(type(c) is BatchKVCache for c in cache)
        n = inputs.shape[1]
        extra = grid_length(n) - n if grid else 0
        if extra:
            inputs = mx.concatenate([inputs, mx.zeros((inputs.shape[0], extra), dtype=inputs.dtype)], axis=1)
        vars(first)["make_mask"] = functools.partial(_causal_mask, first)  # the mask comes from layer 0
        if grid:
            for c in cache:
                vars(c)["update_and_fetch"] = functools.partial(_contiguous_fetch, c)
        try:
            with row_by_row(grid and inputs.shape[0] > 1):
                out = self._model(inputs, cache=cache, **kwargs)
        finally:
            for c in cache:
                vars(c).pop("make_mask", None)
                vars(c).pop("update_and_fetch", None)
        if extra:
            for c in cache:
                c.trim(extra)
            out = out[:, :n]
        return out

    def _padded(self, inputs: Any, cache: Any, **kwargs: Any) -> Any:
        """A step with left padding: mlx_lm's array mask, whose scores MLX materializes; on
        the grid, in chunks whose scores fit `ATTENTION_SCRATCH` (off the grid the actor
        has cut the step already)."""
        rows, n = inputs.shape[0], inputs.shape[1]
        chunk = prefill_chunk(n, rows, cache[0]._idx + n, self._heads) if self.grid and self._heads else n
        if chunk >= n:
            return self._model(inputs, cache=cache, **kwargs)
        outs: list[Any] = []
        for i in range(0, n, chunk):
            if outs:  # as mlx_lm's own chunks: the cache evaluated, the scores freed, between them
                mx.eval([a for c in cache for a in c.state])
            outs.append(self._model(inputs[:, i : i + chunk], cache=cache, **kwargs))
        return mx.concatenate(outs, axis=1)


def _contiguous_fetch(cache: Any, keys: Any, values: Any) -> tuple[Any, Any]:
    k, v = BatchKVCache.update_and_fetch(cache, keys, values)
    return mx.contiguous(k), mx.contiguous(v)


def _host_list(a: Any) -> list[int]:
    """An evaluated (or host-built) array's values: the prompt batch's left padding is one,
    built from a list when the batch forms and evaluated with every prefill chunk."""
    return list(a.tolist())


def _causal_mask(cache: Any, n: int, return_array: bool = False, **kwargs: Any) -> Any:
    if return_array or kwargs.get("window_size"):
        return BatchKVCache.make_mask(cache, n, return_array=return_array, **kwargs)
    return "causal"
