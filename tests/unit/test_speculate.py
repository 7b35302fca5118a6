"""Speculative decoding's rules with no model (`actor/_speculate.py`): prompt-lookup drafts,
the acceptance rule, the per-row policy and the per-width one."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest

from trio_mlx.actor import _speculate
from trio_mlx.actor._speculate import NgramIndex, RowSpec, WidthJudge, accepted, room


def _index(tokens: list[int], n: int = 3) -> NgramIndex:
    index = NgramIndex(n)
    index.extend(tokens)
    return index


def test_prompt_lookup_follows_the_latest_earlier_occurrence_of_the_longest_suffix():
    # "1 2 3" occurs once before (followed by 4 5); its shorter suffix "2 3" also
    # occurred later (followed by 9): the longest match wins, not the latest short one.
    tokens = [1, 2, 3, 4, 5, 6, 2, 3, 9, 7, 1, 2, 3]
    assert _index(tokens).draft(2) == [4, 5]
    # With n = 2 only "2 3" is looked up: its latest earlier occurrence is followed by 9.
    assert _index(tokens, n=2).draft(2) == [9, 7]
    # The latest of several occurrences.
    assert _index([7, 8, 1, 7, 8, 2, 7, 8]).draft(1) == [2]


def test_prompt_lookup_falls_back_to_shorter_matches_and_proposes_nothing_without_one():
    assert _index([5, 6, 7, 1, 2, 8, 9, 7]).draft(3) == [1, 2, 8]  # only "7" matches
    assert _index([5, 6, 7, 1, 2, 8, 9, 7]).draft(3, least=2) == []  # not as long as asked
    assert _index([5, 6, 7, 1, 2, 6, 7]).draft(2, least=2) == [1, 2]  # "6 7" is
    assert _index([1, 2, 3, 4]).draft(4) == []
    assert _index([]).draft(4) == [] and _index([3]).draft(4) == []
    assert _index([1, 2, 1]).draft(0) == []


def test_prompt_lookup_continues_a_copy_past_the_end_of_the_tokens():
    """A repeating pattern drafts its continuation for as many tokens as asked."""
    assert _index([4, 1, 2, 1, 2]).draft(5) == [1, 2, 1, 2, 1]
    assert _index([9, 9, 9]).draft(4) == [9, 9, 9, 9]


@pytest.mark.parametrize("n", [3, 8])
def test_the_index_grown_in_pieces_drafts_as_one_built_at_once(n):
    """Grown token by token or in pieces of any length (a prompt, then a speculative step's
    kept drafts), the index drafts what one built at once drafts, and what the rule says."""
    rng = random.Random(3)
    tokens = [rng.randrange(6) for _ in range(300)]
    for pieces in (False, True):
        grown, i = NgramIndex(n), 0
        while i < len(tokens):
            step = rng.choice([0, 1, 2, 5, 17]) if pieces else 1
            grown.extend(tokens[i : i + step])
            i += step
            whole = _index(tokens[:i], n)
            assert grown.draft(4) == whole.draft(4) == _brute_force(tokens[:i], n, 4)
            assert grown.draft(3, least=2) == whole.draft(3, least=2)
        assert len(grown) == len(tokens)


@pytest.mark.parametrize("n", [2, 3])
def test_the_index_drafts_after_a_token_it_does_not_hold_as_if_it_held_it(n):
    """`match` and `copy` with `after`: the sequence followed by one more token (a row's
    pending token, read back), with the index unchanged."""
    rng = random.Random(11)
    tokens = [rng.randrange(5) for _ in range(120)]
    index = NgramIndex(n)
    for i, t in enumerate(tokens):
        for least in (1, 2):
            at = index.match(least, after=t)
            drafts = [] if at is None else index.copy(at, 6, after=t)
            assert drafts == _index(tokens[: i + 1], n).draft(6, least=least), (i, least)
        index.extend([t])
    assert len(index) == len(tokens)


def test_a_rows_drafts_continue_the_copy_its_guess_came_from():
    """`RowSpec.drafts` takes the tokens after the guess from the match `watch` found, with no
    second search: what a fresh lookup drafts after the guess; none once the index has grown
    past the guess, or without one."""
    rng = random.Random(5)
    tokens = [rng.randrange(5) for _ in range(200)]
    spec, index = RowSpec(), NgramIndex(8)
    for i, t in enumerate(tokens):
        index.extend([t])
        spec.watch(index, 2)
        fresh = index.draft(6, least=2)
        assert spec.guess == (fresh[0] if fresh else None), i
        assert spec.drafts(index, 5) == fresh[1:], i
    index.extend([0])
    assert spec.drafts(index, 5) == []  # guessed for an index one token shorter


def _brute_force(tokens: list[int], n: int, k: int) -> list[int]:
    """The rule written out: the longest suffix (n tokens at most) found earlier, at its latest
    occurrence that has a token after it, and the copy from there."""
    size = len(tokens)
    for m in range(min(n, size - 1), 0, -1):
        suffix = tokens[size - m :]
        for start in range(size - m - 1, -1, -1):
            if tokens[start : start + m] == suffix:
                seq = list(tokens)
                at = start + m
                for i in range(k):
                    seq.append(seq[at + i])
                return seq[size:]
    return []


def test_the_index_needs_a_length():
    with pytest.raises(ValueError):
        NgramIndex(0)


def test_the_target_keeps_the_longest_prefix_of_drafts_equal_to_its_own_tokens():
    assert accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted([4, 5, 6], [8, 5, 6, 7]) == 0
    assert accepted([], [3]) == 0


def test_room_leaves_the_pending_token_and_the_drafts_within_max_tokens():
    assert room(8, 100, 10) == 8
    assert room(8, 15, 10) == 4  # 10 out, 1 pending, 4 drafts: 15
    assert room(8, 11, 10) == 0  # the pending token is the last
    assert room(8, 0, 0) == 0


def test_a_row_with_low_acceptance_stops_speculating_for_longer_each_time():
    spec = RowSpec()
    position = 100
    for _ in range(_speculate.WINDOW):
        assert spec.allowed(position)
        position += 1
        spec.record(8, 0, position)
    assert not spec.allowed(position)
    assert spec.resume_at == position + _speculate.BACKOFF
    position = spec.resume_at
    assert spec.allowed(position)
    for _ in range(_speculate.WINDOW):
        position += 1
        spec.record(8, 0, position)
    assert spec.resume_at == position + 2 * _speculate.BACKOFF
    for _ in range(20):  # never past MAX_BACKOFF
        for _ in range(_speculate.WINDOW):
            position += 1
            spec.record(8, 0, position)
    assert spec.resume_at - position == _speculate.MAX_BACKOFF
    assert spec.drafted == 8 * _speculate.WINDOW * 22 and spec.accepted == 0


def test_a_row_whose_drafts_are_accepted_keeps_speculating():
    spec = RowSpec()
    for i in range(100):
        spec.record(4, 2 if i % 2 else 0, 10 + i)  # one kept a step on average: the bound
        assert spec.allowed(10 + i)
    assert spec.accepted == 100


def test_prompt_lookups_drafts_grow_while_they_are_all_kept_and_start_over_after_a_miss():
    """A copy goes on for tens to hundreds of tokens, and a step costs about as much however
    many it verifies where the host bounds it: a row drafts `START_DRAFT` tokens, twice as
    many after a step that kept all, up to the most, and starts over after one that did not."""
    spec, start = RowSpec(), _speculate.START_DRAFT
    seen = []
    for kept_all in (True, True, True, True, False, True):
        k = spec.next_k(start, 64)
        seen.append(k)
        spec.record(k, k if kept_all else k - 1, 100)
    assert seen == [start, 2 * start, 4 * start, 64, 64, start]
    assert spec.next_k(start, 64) == 2 * start
    assert RowSpec().next_k(4, 4) == 4  # a tuning's most below the start: that, every step
    short = RowSpec()
    short.record(3, 3, 100)  # all kept, fewer than asked (the row's max_tokens near): grows from those
    assert short.next_k(start, 64) == 6


def test_a_row_whose_speculative_steps_give_tokens_slower_than_plain_steps_stops_speculating():
    """Acceptance alone does not say a step pays: a speculative step is not pipelined, and on a
    GPU one that keeps a drafted token now and then took 2.7x a plain step. A window whose
    steps took longer per token they gave than a lone row's plain step stops the row."""
    fast, slow = RowSpec(), RowSpec()
    for i in range(_speculate.WINDOW):
        # 2 drafts kept a step (3 tokens): 9 ms a step is 3 ms a token, against plain steps of 2.5 ms
        slow.record(4, 2, 100 + i, seconds=0.009, plain=0.0025)
        fast.record(4, 2, 100 + i, seconds=0.006, plain=0.0025)  # 2 ms a token: it pays
    assert not slow.allowed(100 + _speculate.WINDOW) and fast.allowed(100 + _speculate.WINDOW)
    unknown = RowSpec()  # no plain step measured yet: acceptance decides alone
    for i in range(_speculate.WINDOW):
        unknown.record(4, 2, 100 + i, seconds=1.0, plain=None)
    assert unknown.allowed(100 + _speculate.WINDOW)


def test_a_width_whose_speculative_steps_give_the_batch_less_than_plain_steps_stops_and_retries_later():
    """A speculative step costs every row of its batch: a window of a width's steps that gave
    the batch fewer tokens than plain steps of that width give in the same time stops that
    width (others go on) for WIDTH_BACKOFF steps, then twice as long after its next stop."""
    judge = WidthJudge()
    window, backoff = _speculate.WIDTH_WINDOW, _speculate.WIDTH_BACKOFF
    for _ in range(window):
        # 2 rows, 6 tokens in 6 ms, where plain steps give 2 in 2.5: it pays
        assert judge.allowed(2)
        judge.record(2, 0.006, 6, 0.0025)
        # 4 rows, one of them kept 3 drafts: 7 tokens in 10 ms, where plain steps give 4 in 2.5
        assert judge.allowed(4)
        judge.record(4, 0.010, 7, 0.0025)
    stopped = judge.steps
    assert judge.allowed(2) and not judge.allowed(4)
    while not judge.allowed(4):
        pass
    assert judge.steps - stopped == backoff  # counted in steps asked about, of any width
    for _ in range(window):
        assert judge.allowed(4)
        judge.record(4, 0.010, 7, 0.0025)
    stopped = judge.steps
    while not judge.allowed(4):
        pass
    assert judge.steps - stopped == 2 * backoff
    unknown = WidthJudge()  # no plain step of the width timed yet: nothing judged
    for _ in range(2 * window):
        assert unknown.allowed(4)
        unknown.record(4, 1.0, 4, None)
    assert unknown.allowed(4)


def test_a_batch_of_one_row_is_left_to_the_rows_own_judgement():
    """A width of one row is never stopped by `WidthJudge` (its step costs no other row):
    the row's `RowSpec` judges the same steps by the same time test, over its own window
    and with its own shorter wait; a width of two losing alike stops."""
    judge = WidthJudge()
    for _ in range(4 * _speculate.WIDTH_WINDOW):
        assert judge.allowed(1)
        judge.record(1, 0.010, 1, 0.0025)  # one token in 10 ms, where a plain step gives it in 2.5
    for _ in range(_speculate.WIDTH_WINDOW):
        assert judge.allowed(2)
        judge.record(2, 0.010, 2, 0.0025)
    assert judge.allowed(1) and not judge.allowed(2)
    row = RowSpec()
    for i in range(_speculate.WINDOW):
        assert row.allowed(100 + i)
        row.record(4, 1, 100 + i, 0.010, 0.0025)  # a kept draft a step: 2 tokens in 10 ms, against 5 ms
    assert not row.allowed(100 + _speculate.WINDOW)
    assert row.allowed(100 + _speculate.WINDOW + _speculate.BACKOFF)


def _gumbel_max(logp: np.ndarray, rng: np.random.Generator) -> int:
    return int(np.argmax(logp + rng.gumbel(size=logp.shape)))


def test_drawing_from_the_target_and_keeping_an_equal_draft_is_the_speculative_sampling_rule():
    """For a point-mass draft t the standard rule accepts t with probability p(t) and else
    samples the residual max(p - q, 0), normalized. The verifier draws x ~ p and keeps t when
    x == t: over many draws the two give the same distribution (p, unchanged), the same
    acceptance rate, and on rejection the residual: checked by chi-square on 6 tokens."""
    p = np.array([0.35, 0.25, 0.2, 0.1, 0.07, 0.03])
    logp = np.log(p)
    rng = np.random.default_rng(7)
    draws = 40_000
    for t in (0, 3, 5):  # a likely draft, a middling one, an unlikely one
        out = np.zeros(len(p))
        rejected = np.zeros(len(p))
        kept = 0
        for _ in range(draws):
            x = _gumbel_max(logp, rng)
            out[x] += 1
            if x == t:
                kept += 1
            else:
                rejected[x] += 1
        assert abs(kept / draws - p[t]) < 4 * math.sqrt(p[t] * (1 - p[t]) / draws)
        assert _chi2(out, p * draws) < _chi2_limit(len(p) - 1)
        residual = p.copy()
        residual[t] = 0.0
        residual /= residual.sum()
        live = residual > 0
        assert rejected[~live].sum() == 0
        assert _chi2(rejected[live], residual[live] * rejected.sum()) < _chi2_limit(int(live.sum()) - 1)


def _chi2(observed: np.ndarray, expected: np.ndarray) -> float:
    return float(((observed - expected) ** 2 / expected).sum())


def _chi2_limit(df: int, z: float = 3.29) -> float:
    """The chi-square statistic exceeded with probability ~5e-4 (Wilson-Hilferty)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def test_the_tuning_names_one_speculation_and_checks_it():
    from trio_mlx import ActorTuning

    assert ActorTuning().speculation is None
    assert ActorTuning(speculative="ngram").speculation == "ngram"
    assert ActorTuning(speculative="ngram").draft_tokens == 32
    assert ActorTuning(draft_model="/m").speculation == "draft"  # implied by the draft model
    assert ActorTuning(draft_model="/m", num_draft_tokens=2).draft_tokens == 2
    assert ActorTuning(speculative="draft", draft_model="/m").draft_tokens == 4
    for bad in (dict(speculative="eagle"), dict(speculative="draft"), dict(speculative="ngram", draft_model="/m"),
                dict(num_draft_tokens=0), dict(num_draft_tokens=65), dict(ngram_size=0),
                dict(speculative="ngram", decode_step="mlx")):
        with pytest.raises(ValueError):
            ActorTuning(**bad)  # type: ignore[arg-type]


def test_a_width_times_a_plain_step_before_it_speculates_and_again_every_so_often():
    """`Decoder.wants_plain`: speculative steps are judged against timed plain steps of their
    width, so a width with none timed (or none for `PLAIN_REFRESH` speculative steps)
    asks for a plain step. (The warm-up's times go with its generator: serving starts a
    fresh one.)"""
    from trio_mlx.actor._decode import PLAIN_REFRESH, Decoder

    d = Decoder()
    assert d.wants_plain(2)
    d.timed_plain(2, 0.01)
    assert not d.wants_plain(2) and d.wants_plain(1) and d.plain_step(2) == 0.01
    d.speculated[2] += PLAIN_REFRESH - 1
    assert not d.wants_plain(2)
    d.speculated[2] += 1
    assert d.wants_plain(2)
    d.timed_plain(2, 0.03)
    assert not d.wants_plain(2) and d.plain_step(2) == 0.03  # the median of 0.01 and 0.03: the later


def _lookup_row(prompt: list[int]) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(max_tokens=1000, spec=None, prompt=tuple(prompt), grammar=None, stops=frozenset())


def _plain_steps(drafter: Any, row: Any, held: list[int], tokens: list[int]) -> list[Any]:
    """Prompt lookup asked before each of the plain steps that sample `tokens` in turn (no
    proposal's drafts kept), the pending token on the device: each step's proposal, whose
    inputs must be that token and then its drafts."""
    import mlx.core as mx

    out = []
    for t in tokens:
        [proposal] = drafter.propose([row], [held], mx.array([t], dtype=mx.int32))
        if proposal is not None:
            assert proposal.inputs.tolist() == [[t, *proposal.host]]
        out.append(proposal)
        held.append(t)
    return out


def test_prompt_lookup_guesses_each_next_token_and_drafts_only_after_enough_hits():
    """Before a row speculates, the lookup's guesses of its tokens (made on the host, checked
    as each token is read back anyway) must have hit GUESS_HITS of the last GUESS_WINDOW
    times: a row copying its prompt starts drafting then. The drafts follow the guess of
    the pending token, which goes into the step as the device has it: never read back."""
    from trio_mlx.actor._drafting import Drafter

    drafter = Drafter(k=4, ngram=3)
    prompt = list(range(1, 21))
    row, held = _lookup_row(prompt), list(prompt)
    # the copy: "20 1" and "1" alone give no guess (two tokens at least), "1 2" guesses 3, ...
    first = _plain_steps(drafter, row, held, [1, 2, 3, 4, 5, 6])
    assert first == [None] * 6
    [proposal] = _plain_steps(drafter, row, held, [7])  # the 4th hit was checked
    assert proposal is not None and proposal.host == [8, 9, 10, 11] and proposal.first is None


def test_prompt_lookup_never_reads_the_pending_token_back():
    """Reading a row's pending token back is a sync that costs the plain step its pipelining.
    The drafts follow the lookup's guess of it, right or wrong (the verify keeps none after
    a wrong one); no guess (the last two tokens never occurred before), or a guess that
    would end the row, and no drafts."""
    from trio_mlx.actor._drafting import Drafter

    drafter = Drafter(k=4, ngram=3)
    prompt = list(range(1, 21))
    row, held = _lookup_row(prompt), list(prompt)
    proposals = _plain_steps(drafter, row, held, [1, 2, 3, 4, 5, 6, 7, 8, 99, 9])
    assert [p and p.host for p in proposals] == [None] * 6 + [
        [8, 9, 10, 11],  # guessed 7
        [9, 10, 11, 12],  # guessed 8
        [10, 11, 12, 13],  # guessed 9: the pending token was 99
        None,  # "8 99" never occurred: no guess, though the last guesses mostly hit
    ]
    stopping = _lookup_row(prompt)
    stopping.stops = frozenset({10})
    proposals = _plain_steps(drafter, stopping, list(prompt), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert proposals[-2] is not None and proposals[-2].host == [10, 11, 12, 13]  # guessed 9
    assert proposals[-1] is None  # guessed 10, which ends the row


def test_after_a_speculative_step_prompt_lookup_drafts_after_the_pending_token_it_read_back():
    """A speculative step reads the row's next pending token back (`RowSpec.known`). Where
    the target cut the drafts short, a guess from the row's tokens alone would be the draft
    the target refused: the lookup drafts after the real token instead, and guesses nothing
    where the text after it was never seen before."""
    import mlx.core as mx

    from trio_mlx.actor._drafting import Drafter

    drafter = Drafter(k=4, ngram=3)
    prompt = list(range(1, 21)) + [50, 9, 99, 30, 31, 32, 33, 34]
    row, held = _lookup_row(prompt), list(prompt)
    *_, proposal = _plain_steps(drafter, row, held, [1, 2, 3, 4, 5, 6, 7])
    assert proposal is not None and proposal.host == [8, 9, 10, 11]
    # the step keeps 8 and 9; the target's own token after 9 is 99, not 10
    held += [8, 9]
    drafter.settle(row, proposal, 2)
    row.spec.known = (len(held), 99)
    [after] = drafter.propose([row], [held], mx.array([99], dtype=mx.int32))
    assert after is not None and after.first == 99 and after.host == [30, 31, 32, 33]
    assert after.inputs.tolist() == [[99, 30, 31, 32, 33]]
    # the next step keeps 30 and 31, then the target says 77: "31 77" never occurred
    held += [99, 30, 31]
    drafter.settle(row, after, 2)
    row.spec.known = (len(held), 77)
    assert drafter.propose([row], [held], mx.array([77], dtype=mx.int32)) == [None]
    # a plain step feeds 77 and samples 78: the lookup guesses again from the row's tokens
    held.append(77)
    assert drafter.propose([row], [held], mx.array([78], dtype=mx.int32)) == [None]


def test_prompt_lookup_on_random_text_never_drafts():
    """Random text over a small vocabulary repeats pairs of tokens all the time, but the
    lookup's guesses of what follows them miss: no speculative step, where drafting wherever
    two tokens repeat (reading the pending token back to draft after it) did on most steps."""
    from trio_mlx.actor._drafting import Drafter

    rng = random.Random(5)
    text = [rng.randrange(16) for _ in range(400)]
    drafter = Drafter(k=4, ngram=3)
    row, held = _lookup_row(text[:100]), text[:100]
    assert _plain_steps(drafter, row, held, text[100:]) == [None] * 300
    pairs = {tuple(text[i : i + 2]) for i in range(99)}
    repeats = 0
    for i in range(100, 400):
        repeats += tuple(text[i - 2 : i]) in pairs
        pairs.add(tuple(text[i - 1 : i + 1]))
    assert repeats > 100  # the steps that would have read back


def test_a_rows_guesses_open_speculation_while_they_hit_and_close_it_when_they_miss():
    spec, index = RowSpec(), NgramIndex(3)
    index.extend([1, 2, 3, 4, 5, 6, 7, 8])
    opened = []
    for t in [1, 2, 3, 4, 5, 6, 7, 8] + [40, 41, 42, 43, 44, 45, 46, 47, 48]:
        opened.append(spec.watch(index, 2))
        index.extend([t])
    # no guess after "8" or "8 1"; "1 2" on hit from the 3rd token; the 4th hit is seen a
    # step later; the new text's guesses all miss: closed once 5 of the last 8 missed
    assert opened == [False] * 6 + [True] * 7 + [False] * 4
