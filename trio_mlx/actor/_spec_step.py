"""The speculative step over the decoding batch: one forward verifies the drafts of every
row that has some while the other rows take their single next token.

`_batch._owned_next` asks for one before each owned decode step (`speculative_step`,
which `_loading.load_drafter` hands it as `Drafter.step`: this module builds on
`_batch.py`'s helpers, so `_batch.py` does not import it);
with no drafts for any row, or a batch the policy leaves alone, the step stays a plain,
pipelined one. The drafts come from `_drafting.Drafter`, the target's token at each
position from `_decode.Decoder.verify`, the acceptance rule and the per-row policy from
`_speculate.py`.

**One forward, every row padded to K+1 tokens.** A step's K is the most drafts any row
has. Every row's input is its pending token, then its drafts, then filler tokens up to
K+1 (a row without drafts: its pending token and K fillers). Causal attention keeps a
position's logits independent of what comes after it, so a row's logits at position 0
are exactly a plain step's, and at position i those after its first i drafts; a row
accepts at most as many positions as it has drafts, so fillers are never kept.

**The rollback: one uniform trim, then the remainder rolled into left padding.** mlx-lm's
`BatchKVCache` (and `_kv_quant.BatchQuantizedKVCache`, in the same layout) keeps every
row right-aligned at one write position `_idx`, with per-row `left_padding` masked out and
per-row `offset` (its real tokens) for the positions. Row r keeps its pending token and
a_r drafts of the K+1 positions it wrote, so K - a_r are stale. The cache is trimmed by
the fewest stale positions of any row (`trim`: `_idx` and every `offset` back), and each
row with e_r stale positions left has its kept positions rolled right by e_r, the stale
ones landing in front as left padding (`left_padding` + e_r, `offset` - e_r): the layout
mlx-lm's own `finalize` leaves after a right-padded prefill, so masks, `filter`,
`extend`, the prompt cache's `copy_rows` (a row's tokens end at `_idx`) and every later
step read the row as if the stale tokens never went in. Padding that every row then has
is cut off the front, as `filter` does. Chosen over running the verifying rows as a
sub-batch of their own: that needs their KV split out and merged back (copies of every
layer's rows, twice a step) and two forwards, where this costs one forward of K+1
tokens a row and, in a step whose rows keep different counts, one copy of every
layer's KV (the roll, joined by concatenation as `_batch.roll_right` joins it).

**The policy.** A row's own (`_speculate.RowSpec`: low acceptance stops it for a while),
and the batch's: no speculation while the batch has more rows than `max_rows`
(`Drafter.max_rows`, the tuning's `speculative_max_rows`): verifying K+1 tokens a row
costs more than it gives once the forward is no longer bound by reading the weights.
A step's time judges each of its speculating rows too: against the plain steps of a
batch of the same width (`Decoder.plain_step`; a width with none timed lately takes plain
steps until one is, `Decoder.wants_plain`), each of which gives every row one token;
and the batch's width, by what its speculative steps gave all its rows
(`_speculate.WidthJudge`). And none while a sequence waits for its first token
(`_batch.first_token_waits`, asked by `_batch._owned_next` before this step): the steps
that prefill it, sample it and report it each add to its time to first token, and a
speculative step takes longer than a plain one, and is not pipelined. And none beside other
rows while no row is padded (`_batch.unmask_unpadded` says: rows that entered together with prompts of
one length, in lockstep): rows that keep different counts of drafts leave padding that
every later step pays for, a cost no judge of the step itself sees. On an H200 (1B shape,
four users on random prompts of one length) the first kept draft made each later plain
step 4.21 ms against 3.71 and split the rows' ends, so their next prompts entered beside
decoding rows, each entry a 13-19 ms step: 0.83x the tokens of no speculation
(BENCHMARKS.md). Served rows seldom sit in lockstep; a row alone always may.
On random text, where drafts are few and short, a speculative step that keeps a draft
now and then costs more than the tokens it gives, and its rows stop speculating for a
while (docs/server.md, "Speculative decoding").

**Constrained rows.** A row with a grammar has each position's logits masked by what its
grammar allows there (`Decoder.spec_masks`): position 0 by the mask its plain step
would have, position i by the mask after its first i drafts, its matcher advanced
through them tentatively and stopping at the first draft the grammar forbids (the row
keeps no draft from there on). After the acceptance its matcher is rolled back to the
drafts it kept (`GrammarProcessor.keep`). A constrained row without drafts (its endgame,
`GrammarProcessor.draft_room`) still takes its position 0 with its mask. The masks
need the drafts on the host: the step reads its inputs back once the forward is started
(every step starts it first: a draft model's drafts, read alone, would stall the device
between the last draft and the verify) and fills the masks while the device runs it.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from ._batch import Decoded, Speculated, _kv_caches, adapter_rows, roll_right
from ._decode import Decoder
from ._drafting import Proposal
from ._kv_quant import kv_map
from ._speculate import accepted
from ._step_caches import share_offsets, unmask_unpadded


def speculative_step(decoder: Decoder, batch: Any) -> Decoded | None:
    """The batch's speculative step (the module's docstring), or None: no row has drafts
    this step, or the policy leaves the batch alone, and the caller takes a plain step."""
    drafter = decoder.drafter
    rows, helds, n = batch.samplers, batch.tokens, len(batch.uids)
    if drafter is None or not 1 <= n <= drafter.max_rows or not drafter.widths.allowed(n):
        return None
    if drafter.judging and decoder.wants_plain(n):
        return None  # a plain step of this width, timed: what its speculative steps are judged against
    caches = batch.prompt_cache if n == 1 else _kv_caches(batch)
    if not caches:
        return None  # rows at different positions: no layout to roll back into
    if unmask_unpadded(caches) and n > 1:
        return None  # rows in lockstep: a kept draft would pad every step after it (docstring)
    t0 = time.perf_counter()
    drafter.filled()  # from here, what the draft model's history fills take is this step's
    pending = batch._next_tokens
    proposals: list[Proposal | None] = drafter.propose(rows, helds, pending)
    if all(p is None for p in proposals):
        return None
    k = max(p.k for p in proposals if p is not None)
    inputs = mx.concatenate([_padded(p, pending[i : i + 1], k) for i, p in enumerate(proposals)])
    batch._current_tokens = pending
    batch._current_logprobs = batch._next_logprobs
    with adapter_rows(batch.model, batch.uids):
        logits = batch.model.verify(inputs, cache=caches)
    share_offsets(caches)
    width = logits.shape[-1]
    room = [0 if p is None else p.k for p in proposals]  # the drafts each row may keep
    masks: list[Any] = [None] * n
    # The forward goes to the device before the host reads the inputs back: a draft model's
    # drafts are part of its graph, so reading them alone first would leave the device idle
    # from the last draft until the verify is submitted; and where a constrained row fills
    # masks, the device runs the forward meanwhile.
    mx.async_eval(logits)
    constrained = any(r.grammar is not None for r in rows)
    if constrained:  # the masks need the drafts on the host now: a read of its own
        fed: list[list[int]] = inputs.tolist()  # type: ignore[assignment]
        for i, r in enumerate(rows):
            if r.grammar is not None:
                masks[i], room[i] = decoder.spec_masks(r, width, fed[i], room[i])
    verified = [decoder.verify(logits[i], r, inputs[i, 1:], masks[i]) for i, r in enumerate(rows)]
    sampled = mx.stack([s for s, _ in verified])
    if constrained:
        targets: list[list[int]] = sampled.tolist()  # type: ignore[assignment]
    else:  # one read for both, once the verify's graph is built: no wait before it
        both: list[list[int]] = mx.concatenate([inputs, sampled.astype(inputs.dtype)], axis=1).tolist()  # type: ignore[assignment]
        fed, targets = [b[: k + 1] for b in both], [b[k + 1 :] for b in both]
    kept = [accepted(fed[i][1 : 1 + room[i]], targets[i]) for i in range(n)]
    for r, a in zip(rows, kept, strict=True):
        if r.grammar is not None:
            r.grammar.keep(a)
    rollback(caches, [k - a for a in kept])
    seconds, plain = time.perf_counter() - t0 - drafter.filled(), decoder.plain_step(n) if drafter.judging else None
    drafter.widths.record(n, seconds, n + sum(kept), plain)
    firsts: list[int] = []
    specs: list[Speculated | None] = []
    for i, (row, held, p, a) in enumerate(zip(rows, helds, proposals, kept, strict=True)):
        outs = decoder.settle(row, targets[i][: a + 1], verified[i][1])
        first, drafts = fed[i][0], fed[i][1 : 1 + a]
        held.append(first)
        held.extend(drafts)
        firsts.append(first)
        if row.spec is not None:  # the row's next pending token, on the host now (`RowSpec.known`)
            row.spec.known = (len(held), targets[i][a])
        if p is None:
            specs.append(None)
            continue
        drafter.settle(row, p, a, seconds, plain)
        specs.append(Speculated(drafts, outs, p.k))
    decoder.speculated_last = True
    decoder.speculated[n] += 1
    batch._next_tokens = mx.array([targets[i][a] for i, a in enumerate(kept)], dtype=pending.dtype)
    batch._next_logprobs = [None] * n
    return Decoded(list(batch.uids), firsts, list(rows), specs)


def _padded(p: Proposal | None, pending: Any, k: int) -> Any:
    """A row's input to the step, (1, k+1): its proposal's (pending token and drafts), or
    its pending token alone, then filler tokens (never kept: the module's docstring)."""
    x = pending[None] if p is None else p.inputs.astype(pending.dtype)
    short = k + 1 - x.shape[1]
    return mx.concatenate([x, mx.zeros((1, short), dtype=pending.dtype)], axis=1) if short else x


def rollback(caches: list[Any], stale: list[int]) -> None:
    """Take each row's `stale[r]` last positions out of the batch's caches (`BatchKVCache`s,
    or `BatchQuantizedKVCache`s, all at one `_idx`; the module's docstring): a uniform trim
    by the fewest, then the rest rolled into left padding, row by row."""
    least = min(stale)
    if least:
        for c in caches:
            c.trim(least)
    extra = [s - least for s in stale]
    if not any(extra):
        return
    first = caches[0]
    idx = first._idx
    padding = [p + e for p, e in zip(first.left_padding.tolist(), extra, strict=True)]
    cut = min(padding)  # padding every row has now: off the front
    shifts = mx.array(extra)
    for c in caches:
        if c.keys is not None:
            c.keys = kv_map(lambda a: _rolled(a, idx, extra, cut), c.keys)
            c.values = kv_map(lambda a: _rolled(a, idx, extra, cut), c.values)
        c.offset = c.offset - shifts
        c.left_padding = c.left_padding + shifts - cut
        c._idx -= cut


def _rolled(a: Any, idx: int, shifts: list[int], cut: int) -> Any:
    """`a`'s first `idx` positions, each row rolled right by its shift (`_batch.roll_right`),
    the first `cut` of them dropped; the buffer past `idx` kept for the next writes."""
    head = roll_right(a[..., :idx, :], shifts)[..., cut:, :]
    return mx.concatenate([head, a[..., idx:, :]], axis=2) if a.shape[2] > idx else head
