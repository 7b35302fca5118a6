"""Speculative decoding's drafters: prompt lookup, or a small draft model, for each row of
a decoding batch.

`Drafter.propose` says whether a row speculates this step and with which drafted
tokens; `_spec_step.py` runs the step (one forward over every row's pending token and
drafts, `_decode.Decoder.verify`, each row's KV rolled back past its rejected drafts) and
hands each row's outcome back (`Drafter.settle`). A draft model drafts for the rows of
a batch in one batch of forwards, each row from its own cache. The rules (the n-gram index, the acceptance rule, the
per-row policy) are `_speculate.py`'s, with no MLX.

- **Prompt lookup** (`mode="ngram"`) drafts from the row's own tokens, as far as the
  host has them: the row's KV's tokens, the pending one still on the device. It guesses
  the pending token from them (the token after the latest earlier occurrence of their
  longest suffix, of `MIN_MATCH` tokens at least) and checks the guess when the token
  comes back (`RowSpec.watch`); after a speculative step, which reads it back, it drafts
  after the pending token itself. Where its last guesses mostly missed, no speculation:
  the step stays a plain, pipelined one, and random text costs nothing. Otherwise the
  drafts are the K tokens that followed the guess, fed after the pending token as the
  device computes it: nothing is read back before the step (a read of the pending
  token costs a plain step its pipelining: on an H200 four rows' plain steps took
  ~3 ms longer while prompt lookup read it back to draft after it).
- **A draft model** (`mode="draft"`) drafts K tokens greedily, each from its own KV cache
  (a plain mlx-lm cache per layer, filled with the row's prompt and output the first time
  the row speculates, and kept after). Its input starts with the row's pending token as
  the device computes it: the draft, the verification and the sampling are read back
  once (each drafted token goes to the device as soon as its graph is built, so the
  device runs a draft's forward while the host builds the next). Its cache is trimmed past the drafts the target rejected, as the
  target's is.

Rows that speculate side by side draft in one batch of draft forwards, their caches
joined for the step with mlx-lm's `BatchKVCache.merge` and split back after.

Only public mlx-lm API here (a model's call, `make_prompt_cache`, `BatchKVCache.merge`, a
cache's `trim` and its `keys`, `values` and `offset`); on CUDA the draft's steps of
several tokens attend as matmuls (`_shapes.few_queries`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from ._decode import DecodeRow
from ._shapes import few_queries, prefill_grid
from ._speculate import MIN_MATCH, START_DRAFT, NgramIndex, RowSpec, WidthJudge, room

# The most of a row's tokens its prompt-lookup index takes in one step: a long prompt's index
# is built over several steps, not in one that stalls every row of the batch (a 128k-token
# prompt's took ~0.3 s of host time at 8-token suffixes, on a slow host); the row's lookup
# guesses nothing until its index is whole.
INDEX_SLICE = 2048


class DraftState:
    """A row's KV in the draft model: its caches and how many of the row's tokens they hold."""

    __slots__ = ("cache", "held")

    def __init__(self, cache: list[Any]):
        self.cache = cache
        self.held = 0


class Proposal:
    """One speculative step's drafts for a row: the forward's `inputs` (1, K+1): the row's
    pending token and then `drafts` (K,), lazy for a draft model's; `first` and `host`, the
    pending token and the drafts where the drafter has them on the host (prompt lookup:
    the drafts, and the pending token where a speculative step read it back)."""

    __slots__ = ("inputs", "drafts", "first", "host", "position")

    def __init__(self, inputs: Any, drafts: Any, first: int | None, host: list[int] | None, position: int):
        self.inputs, self.drafts, self.first, self.host = inputs, drafts, first, host
        self.position = position  # the tokens the row's KV held before the step

    @property
    def k(self) -> int:
        return int(self.drafts.shape[0])


class Drafter:
    """Drafts for decoding rows: prompt lookup (`ngram`: the longest suffix of up to `ngram`
    tokens; a row's drafts a step grow from `_speculate.START_DRAFT` while they are all
    kept), or a draft `model` (its logits cut to the target's `width`); `k` drafted tokens
    a step at most; none in a batch of more than `max_rows` rows."""

    def __init__(self, k: int, ngram: int = 3, model: Any = None, width: int = 0, prefill_step: int = 2048,
                 max_rows: int = 8, step: Callable[[Any, Any], Any] | None = None):
        if k < 1:
            raise ValueError(f"speculation needs at least one drafted token a step, got {k}")
        self.k = k
        self.max_rows = max(1, max_rows)  # no speculation in a batch of more rows (`_spec_step.py`)
        # The step that verifies the drafts (`_spec_step.speculative_step`), which builds on
        # `_batch.py`'s helpers: handed in, so that `_batch.py` calls it without importing it.
        self.step = step
        self.ngram = ngram
        self.least = min(MIN_MATCH, ngram)  # the shortest suffix prompt lookup guesses and drafts from
        self.model = model
        self.width = width
        self.prefill_step = max(1, prefill_step)
        # On CUDA a draft's steps of a few tokens attend as matmuls (`_shapes.few_queries`)
        self.few_as_matmuls = model is not None and prefill_grid()
        self.widths = WidthJudge()  # which batch widths speculate (`_spec_step.py`)
        self.judging = True  # whether steps are judged by their time (`unjudged`)
        # Wall seconds the draft model spent this step filling rows' histories (`filled`)
        self._filling = 0.0

    @contextlib.contextmanager
    def unjudged(self) -> Iterator[None]:
        """Speculative steps not judged by their time while it is open (the warm-up's
        rehearsal: its steps build kernels, and their times say nothing of serving's; judged,
        they stopped the speculation the rehearsal is there to run), each width's record
        forgotten after."""
        self.judging = False
        try:
            yield
        finally:
            self.judging = True
            self.widths = WidthJudge()

    @property
    def mode(self) -> str:
        return "ngram" if self.model is None else "draft"

    def propose(self, rows: Sequence[DecodeRow], helds: Sequence[list[int]], pending: Any) -> list[Proposal | None]:
        """Each row's drafts this step, or None for a row that takes a plain step. `helds`:
        the tokens each row's KV holds (prompt and output); `pending`: each row's next token,
        sampled last step (on the device, (B,)). A draft model drafts for every row that
        speculates in one batch (`_draft_batch`)."""
        ks = [self._room(r, h) for r, h in zip(rows, helds, strict=True)]
        if self.model is None:
            looked: list[Proposal | None] = []
            for i, (r, h, k) in enumerate(zip(rows, helds, ks, strict=True)):
                if k:
                    looked.append(self._lookup(r, r.spec, h, pending[i : i + 1], k))
                else:
                    self._watch(r, h)
                    looked.append(None)
            return looked
        drafting = [i for i, k in enumerate(ks) if k]
        out: list[Proposal | None] = [None] * len(rows)
        if len(drafting) == 1:
            i = drafting[0]
            out[i] = self._draft(rows[i].spec, helds[i], pending[i : i + 1], ks[i])
        elif drafting:
            made = self._draft_batch([rows[i].spec for i in drafting], [helds[i] for i in drafting],
                                     pending[mx.array(drafting)] if len(drafting) < len(rows) else pending,
                                     [ks[i] for i in drafting])
            for i, p in zip(drafting, made, strict=True):
                out[i] = p
        return out

    def _room(self, row: DecodeRow, held: list[int]) -> int:
        """How many tokens `row` may draft this step (0: it takes a plain step)."""
        if row.max_tokens <= 0:
            return 0
        spec = row.spec
        if spec is None:
            row.spec = spec = RowSpec()
        position = len(held)
        if not spec.allowed(position):
            return 0
        # prompt lookup's length grows while a row's copy holds (`_speculate.START_DRAFT`); a
        # draft model's costs a forward a token, so it drafts `k` each step
        most = self.k if self.model is not None else spec.next_k(START_DRAFT, self.k)
        k = room(most, row.max_tokens, position - len(row.prompt))
        if row.grammar is not None:  # a constrained row drafts only far from its budget's endgame
            k = min(k, row.grammar.draft_room())
        return max(0, k)

    def settle(self, row: DecodeRow, proposal: Proposal, accepted: int, seconds: float | None = None,
               plain: float | None = None) -> None:
        """The step kept `accepted` of the proposal's drafts, in `seconds`: the draft model's
        cache drops what it holds past them, and the row's policy counts the step against
        `plain`, a plain step of a batch as wide (`RowSpec.record`; None: none timed yet,
        its acceptance alone judges it)."""
        spec = row.spec
        assert spec is not None
        k = proposal.k
        state = spec.draft
        if isinstance(state, DraftState):
            # It fed the pending token and the first k-1 drafts; the row keeps the pending
            # token and `accepted` drafts (and the target's next token, fed next step).
            extra = max(0, k - 1 - accepted)
            if extra:
                for c in state.cache:
                    c.trim(extra)
                state.held -= extra
        spec.record(k, accepted, proposal.position + 1 + accepted, seconds, plain)

    # -- the drafters ---------------------------------------------------------------

    def _index(self, spec: RowSpec, held: list[int]) -> NgramIndex | None:
        """The row's prompt-lookup index, brought up to the tokens its KV holds, at most
        INDEX_SLICE of them a step; None while it holds fewer (its suffix is not the row's:
        nothing to guess or draft from yet)."""
        index = spec.index
        if index is None or len(index) > len(held):  # (the latter a bug's guard: it only grows with them)
            spec.index = index = NgramIndex(self.ngram)
        index.extend(held[len(index) : len(index) + INDEX_SLICE])
        return index if len(index) == len(held) else None

    def _watch(self, row: DecodeRow, held: list[int]) -> None:
        """A row that may not speculate this step still has prompt lookup's guesses checked
        and made (`RowSpec.watch`), so that they say what its text does now when it may."""
        if row.spec is not None and row.max_tokens > 0 and (index := self._index(row.spec, held)) is not None:
            row.spec.watch(index, self.least)

    def _lookup(self, row: DecodeRow, spec: RowSpec, held: list[int], pending: Any, k: int) -> Proposal | None:
        index = self._index(spec, held)
        if index is None or not spec.watch(index, self.least):
            return None  # the lookup's last guesses missed: a plain step, pipelined
        known = spec.known_at(len(held))
        if spec.guess is None or (spec.guess if known is None else known) in row.stops:
            return None  # no guess, or a pending token that ends the row: nothing to follow it
        # The guess and the k tokens after it (the same longest suffix): the drafts follow the
        # guess, and the pending token itself goes in as the device computes it, never read back.
        # Where the guess missed, the verify keeps none of them; the acceptance is exact either way.
        # Where a speculative step read the pending token back, the drafts follow it (`watch`).
        drafts = spec.drafts(index, k)
        inputs = mx.concatenate([pending, mx.array(drafts, dtype=pending.dtype)])[None]
        return Proposal(inputs, inputs[0, 1:], known, drafts, len(held))

    def _state(self, spec: RowSpec) -> DraftState:
        state = spec.draft
        if not isinstance(state, DraftState):
            spec.draft = state = DraftState(make_prompt_cache(self.model))
        return state

    def _fill(self, state: DraftState, tokens: list[int], dtype: Any) -> None:
        """Feed the draft model a row's tokens its cache lacks, in chunks, evaluated (a long
        history: the row's first speculation)."""
        t0 = time.perf_counter()
        step = self.prefill_step
        for at in range(0, len(tokens), step):
            self.model(mx.array(tokens[at : at + step], dtype=dtype)[None], cache=state.cache)
            mx.eval([c.state for c in state.cache])
        state.held += len(tokens)
        self._filling += time.perf_counter() - t0

    def filled(self) -> float:
        """Seconds spent since the last call filling rows' histories into the draft model: a
        row's first speculation pays its whole prompt (an agent's: thousands of tokens) once,
        which is not what its steps cost, so the step's judged time leaves it out."""
        seconds, self._filling = self._filling, 0.0
        return seconds

    def _draft(self, spec: RowSpec, held: list[int], pending: Any, k: int) -> Proposal:
        model = self.model
        state = self._state(spec)
        cache = state.cache
        new = held[state.held:]
        if len(new) > self.prefill_step:  # a long history (the row's first speculation): whole chunks first
            cut = (len(new) - 1) // self.prefill_step * self.prefill_step
            self._fill(state, new[:cut], pending.dtype)
            new = new[cut:]
        x = mx.concatenate([mx.array(new, dtype=pending.dtype), pending]) if new else pending
        drafts = []
        with few_queries(self.few_as_matmuls):
            for _ in range(k):
                logits = model(x[None], cache=cache)[:, -1, : self.width or None]
                x = mx.argmax(logits, axis=-1).astype(pending.dtype)
                # to the device now: it runs this draft's forward while the host builds the next
                # one's graph (a small draft model's forward is bound by that host work)
                mx.async_eval(x)
                drafts.append(x)
        state.held = len(held) + k  # the history, the pending token, every draft but the last
        d = mx.concatenate(drafts)
        return Proposal(mx.concatenate([pending, d])[None], d, None, None, len(held))

    def _draft_batch(self, specs: list[RowSpec], helds: list[list[int]], pending: Any,
                     ks: list[int]) -> list[Proposal]:
        """Several rows' drafts in one batch of draft forwards: the rows' caches joined for the
        step (left-padded, `BatchKVCache.merge`) and split back after, a copy of the draft's
        KV a step, where drafting row by row costs a forward a row for each drafted token
        (the forwards of a small draft model are bound by host work, the copies are not).
        Every row feeds two tokens first: its last held token and its pending one (a row
        whose cache holds every held token gives its last back, to feed it again)."""
        dtype = pending.dtype
        states = [self._state(spec) for spec in specs]
        for state, held in zip(states, helds, strict=True):
            if state.held >= len(held):
                for c in state.cache:
                    c.trim(state.held - len(held) + 1)
                state.held = len(held) - 1
            elif state.held < len(held) - 1:
                self._fill(state, held[state.held : -1], dtype)
        lengths = [state.cache[0].size() for state in states]
        caches = [BatchKVCache.merge(list(layer)) for layer in zip(*(s.cache for s in states), strict=True)]
        x = mx.concatenate([mx.array([[h[-1]] for h in helds], dtype=dtype), pending[:, None]], axis=1)
        top = max(ks)
        drafts = []
        with few_queries(self.few_as_matmuls):
            for _ in range(top):
                logits = self.model(x, cache=caches)[:, -1, : self.width or None]
                x = mx.argmax(logits, axis=-1, keepdims=True).astype(dtype)
                mx.async_eval(x)  # as `_draft`: the device runs it while the host builds the next
                drafts.append(x)
        d = mx.concatenate(drafts, axis=1)
        longest = max(lengths)
        end = longest + top + 1  # each row's two tokens, then one a draft but the last
        out = []
        for i, (state, held, k) in enumerate(zip(states, helds, ks, strict=True)):
            start = longest - lengths[i]  # the row's left padding
            for layer, c in enumerate(state.cache):
                c.keys, c.values = caches[layer].keys[i : i + 1, :, start:end], caches[layer].values[i : i + 1, :, start:end]
                c.offset = end - start
                if top > k:
                    c.trim(top - k)  # the drafts past the row's own k: as if it had drafted k
            state.held = len(held) + k  # the history, the pending token, every draft but the last
            out.append(Proposal(mx.concatenate([pending[i : i + 1], d[i, :k]])[None], d[i, :k], None, None, len(held)))
        return out
