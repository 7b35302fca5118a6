"""Speculative decoding through the actor (`actor/_drafting.py`, `_spec_step.py`,
`_decode.Decoder.verify`), on the tiny fp32 model: a lone row, and rows that speculate
beside rows that do not in one batch.

A random model never copies its context, so besides the real prompt lookup these tests
draft with an oracle: the tokens the same request makes without speculation, some of
them spoiled on purpose. Whatever the drafts, every output must be the one without
speculation, token for token (greedy and seeded rows alike: the verifier draws each
position as a plain step would), the KV the row leaves behind the same, and the finish
rule applied token by token.
"""

from __future__ import annotations

import collections
import copy
import functools
import json
import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from trio_mlx.actor import (
    Abort,
    ActorConfig,
    ActorTuning,
    Grammar,
    SamplingParams,
    Submit,
    _drafting,
)
from trio_mlx.actor._actor import Actor
from trio_mlx.actor._batch import batch_rows
from trio_mlx.actor._decode import Decoder, DecodeRow
from trio_mlx.actor._drafting import Proposal
from trio_mlx.actor._tuning import MAX_DRAFT

PROMPT = tuple(range(5, 40))
REPEATING = tuple([5, 6, 7, 8, 9, 10, 11, 12] * 6)
# The tiny model's greedy output after this prompt falls into a loop (one token over and
# over) within a few tokens: prompt lookup's guesses hit, and it drafts. After REPEATING
# its output seldom repeats: the guesses miss, and it does not.
LOOPING = (13, 70) * 15
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=3)
EVERYTHING = SamplingParams(temperature=0.8, top_k=40, min_p=0.02, seed=11, repetition_penalty=1.2,
                            frequency_penalty=0.3, presence_penalty=0.2, logit_bias=((50, 2.0),), logprobs=True,
                            top_logprobs=2)


@pytest.fixture(autouse=True)
def _untimed(monkeypatch: pytest.MonkeyPatch) -> None:
    """No speculative step here is judged by the time it took (`Decoder.plain_step` knows no
    plain step): what these tests check is the tokens and the KV, which the judges never
    change, and a loaded machine's timings would stop rows at random. The judges' own tests
    set the plain steps' time themselves."""
    monkeypatch.setattr(Decoder, "plain_step", lambda self, width: None)
    monkeypatch.setattr(Decoder, "wants_plain", lambda self, width: False)


class _Link:
    def built(self) -> None:
        pass


def _judged(monkeypatch: pytest.MonkeyPatch) -> list[float | None]:
    """The plain step's time each speculating row's step was judged against (None: not judged),
    in the order the rows settled."""
    judged: list[float | None] = []
    settle = _drafting.Drafter.settle

    def spy(self: Any, row: Any, proposal: Any, accepted: int, seconds: Any = None, plain: Any = None) -> None:
        judged.append(plain)
        settle(self, row, proposal, accepted, seconds, plain)

    monkeypatch.setattr(_drafting.Drafter, "settle", spy)
    return judged


def _actor(path: Path, **tuning: Any) -> Actor:
    actor = Actor(ActorConfig(model_path=path, tuning=ActorTuning(**{"warmup": False, "admit_window": 0.0,
                                                                      **tuning})), link=_Link())  # type: ignore[arg-type]
    actor._load()
    return actor


class Run:
    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = collections.defaultdict(list)
        self.reasons: dict[int, str | None] = {}
        self.logprobs: dict[int, list[Any]] = collections.defaultdict(list)
        self.speculated: list[tuple[int, int, int]] = []
        self.spec_steps: list[int] = []  # the steps that were speculative
        self.last: dict[int, int] = {}  # the step each rid's last token came in
        self.first: dict[int, int] = {}  # ... and its first
        self.rows: list[int] = []  # the decoding batch's rows after each step
        self.steps = 0


def _serve(actor: Actor, script: dict[int, list[Any]], steps: int = 200) -> Run:
    """The actor's own `_apply`, `_step` and `settle` (as its loop runs them) until it runs dry,
    `script[k]` applied before step k."""
    run = Run()
    for k in range(steps):
        failed = actor._apply(script.get(k, []))
        report = actor._step(failed or [])
        assert not report.failed, report.failed
        for t in report.tokens:
            assert t.rid not in run.reasons, "a token after the sequence ended"
            run.tokens[t.rid].append(t.token)
            run.logprobs[t.rid].append((t.logprob, t.top_logprobs))
            run.last[t.rid] = k
            run.first.setdefault(t.rid, k)
            if t.finish_reason is not None:
                run.reasons[t.rid] = t.finish_reason
        run.speculated += report.speculated
        run.spec_steps += [k] * len(report.speculated)
        run.rows.append(batch_rows(actor._bg))
        run.steps = k + 1
        actor.settle()
        if k >= max(script, default=0) and not actor.schedule.seqs:
            break
    return run


_PLAIN: dict[str, Run] = {}


def _plain(path: Path, script: dict[int, list[Any]], steps: int = 200) -> Run:
    """`_serve` of a fresh actor without speculation (default tuning): the reference the tests
    compare speculation with. It is deterministic (greedy and seeded rows alike), and what the
    tests patch (drafts, judges, the verify's attention) never reaches a step without
    speculation, so each script is served once a module run and every test that compares with
    it gets a copy of its own (the constrained rows' 472 tokens: ~1 CPU-s a serve)."""
    key = repr((str(path), sorted(script.items()), steps))
    if key not in _PLAIN:
        _PLAIN[key] = _serve(_actor(path), script, steps)
    return copy.deepcopy(_PLAIN[key])


def _one(path: Path, sp: SamplingParams, max_tokens: int = 48, prompt: tuple[int, ...] = PROMPT,
         stops: frozenset[int] = frozenset(), **tuning: Any) -> Run:
    script = {0: [Submit(1, prompt, max_tokens, sp, stops)]}
    return _serve(_actor(path, **tuning), script) if tuning else _plain(path, script)


def _oracle(monkeypatch: pytest.MonkeyPatch, answer: list[int], spoil: float = 0.0, seed: int = 0) -> None:
    """Prompt lookup replaced by drafts from `answer` (the request's tokens without speculation),
    each proposal spoiled at a random position with probability `spoil`."""
    _oracles(monkeypatch, {}, spoil, seed, default=answer)


@pytest.mark.parametrize("sp", [GREEDY, SEEDED, EVERYTHING], ids=["greedy", "seeded", "penalties-logprobs"])
def test_outputs_and_logprobs_are_unchanged_whatever_the_drafts_hold(tiny_model_fp32, monkeypatch, sp):
    """Drafts that are all right (every one kept: a step makes K+1 tokens), then drafts spoiled
    at random (some kept, the KV trimmed past the rest): the same tokens as without
    speculation, and the same logprobs for every token, drafted or not."""
    base = _one(tiny_model_fp32, sp)
    answer = base.tokens[1]
    assert len(answer) == 48 and base.reasons[1] == "length"
    for spoil in (0.0, 0.5):
        _oracle(monkeypatch, answer, spoil)
        spec = _one(tiny_model_fp32, sp, speculative="ngram", num_draft_tokens=5)
        assert spec.tokens[1] == answer, spoil
        assert spec.reasons[1] == "length"
        drafted = sum(d for _, d, _ in spec.speculated)
        kept = sum(a for _, _, a in spec.speculated)
        if spoil == 0.0:
            assert kept == drafted > 0 and spec.steps < base.steps // 4
        else:
            assert 0 < kept < drafted
        if sp.logprobs:
            for (a, top_a), (b, top_b) in zip(spec.logprobs[1], base.logprobs[1], strict=True):
                assert a == pytest.approx(b, abs=1e-4)
                assert [t for t, _ in top_a] == [t for t, _ in top_b]


def test_prompt_lookups_drafts_grow_while_a_copy_holds_and_start_over_after_a_miss(tiny_model_fp32, monkeypatch):
    """With the default tuning a row drafts START_DRAFT tokens, twice as many after a step
    that kept them all, up to the most (32), and START_DRAFT again after a step that did
    not; the tokens are the same as without speculation."""
    from trio_mlx.actor._speculate import START_DRAFT

    base = _one(tiny_model_fp32, GREEDY, 160)
    answer = base.tokens[1]
    _oracle(monkeypatch, answer)
    spec = _one(tiny_model_fp32, GREEDY, 160, speculative="ngram")
    assert spec.tokens[1] == answer
    drafted = [d for _, d, _ in spec.speculated]
    assert drafted[:3] == [START_DRAFT, 2 * START_DRAFT, 32], drafted
    assert max(drafted) == 32
    _oracle(monkeypatch, answer, spoil=1.0)  # every proposal has a wrong draft somewhere
    spoiled = _one(tiny_model_fp32, GREEDY, 160, speculative="ngram")
    assert spoiled.tokens[1] == answer
    assert {d for _, d, a in spoiled.speculated if a < d} and max(d for _, d, _ in spoiled.speculated) == START_DRAFT


def test_prompt_lookup_on_a_repeating_prompt_keeps_greedy_tokens_and_its_drafts_pay(tiny_model_fp32):
    """The real drafter: a prompt that repeats a phrase, a greedy row; the tiny model's output
    falls into loops, which prompt lookup drafts. Same tokens as without speculation (and
    as mlx_lm's own generation); some drafts kept."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    base = _one(tiny_model_fp32, GREEDY, 60, LOOPING)
    spec = _one(tiny_model_fp32, GREEDY, 60, LOOPING, speculative="ngram")
    assert spec.tokens[1] == base.tokens[1]
    model, _ = load_model(tiny_model_fp32)
    assert spec.tokens[1] == [int(t) for t, _ in generate_step(mx.array(LOOPING), model, max_tokens=60)]
    assert sum(a for _, _, a in spec.speculated) > 0


def test_after_a_speculative_step_prompt_lookup_knows_the_rows_pending_token(tiny_model_fp32, monkeypatch):
    """A speculative step leaves each row's next pending token on the host (`RowSpec.known`,
    at the position it takes in the row's tokens), so the next lookup drafts after it: it
    is the token the device then feeds. Same tokens as without speculation."""
    seen: list[tuple[int, int]] = []
    lookup = _drafting.Drafter._lookup

    def checked(self: Any, row: DecodeRow, spec: Any, held: list[int], pending: Any, k: int) -> Proposal | None:
        if (known := spec.known_at(len(held))) is not None:
            seen.append((known, int(pending.item())))
        return lookup(self, row, spec, held, pending, k)

    monkeypatch.setattr(_drafting.Drafter, "_lookup", checked)
    base = _one(tiny_model_fp32, GREEDY, 60, LOOPING)
    spec = _one(tiny_model_fp32, GREEDY, 60, LOOPING, speculative="ngram")
    assert spec.tokens[1] == base.tokens[1]
    assert len(seen) >= 2 and all(known == pending for known, pending in seen), seen


def test_a_long_prompts_index_is_built_a_slice_a_step(tiny_model_fp32, monkeypatch):
    """Prompt lookup's index of a row takes at most INDEX_SLICE of its tokens a step (a long
    prompt's whole index at once stalled every row of the batch), and the row guesses and
    drafts nothing until the index holds them all: the first speculative step comes after
    it; the tokens are those without speculation, and the loop is still drafted."""
    from trio_mlx.actor import _drafting
    from trio_mlx.actor._speculate import NgramIndex

    monkeypatch.setattr(_drafting, "INDEX_SLICE", 8)
    sizes: list[int] = []
    extend = NgramIndex.extend

    def counted(self: NgramIndex, new: Any) -> None:
        new = list(new)
        sizes.append(len(new))
        extend(self, new)

    monkeypatch.setattr(NgramIndex, "extend", counted)
    base = _one(tiny_model_fp32, GREEDY, 60, LOOPING)
    spec = _one(tiny_model_fp32, GREEDY, 60, LOOPING, speculative="ngram")
    assert spec.tokens[1] == base.tokens[1]
    assert max(sizes) == 8 and sizes[:4] == [8, 8, 8, 8]  # the 30-token prompt and the first token, 4 steps
    assert sum(a for _, _, a in spec.speculated) > 0
    assert spec.spec_steps[0] >= 4


def test_prompt_lookup_takes_no_speculative_step_on_text_its_guesses_miss(tiny_model_fp32):
    """After REPEATING the tiny model's greedy text seldom repeats itself (3 of its 60 tokens
    guessed in a row at best): prompt lookup's guesses of its tokens miss, so it never
    speculates (no trial steps to learn that its drafts are not kept, where drafting
    wherever two tokens repeat took some), and the tokens are those without it."""
    run = _one(tiny_model_fp32, GREEDY, 60, REPEATING, speculative="ngram")
    assert run.tokens[1] == _one(tiny_model_fp32, GREEDY, 60, REPEATING).tokens[1]
    assert run.speculated == [] and run.spec_steps == []


def test_seeded_sampling_with_prompt_lookup_is_reproducible(tiny_model_fp32):
    runs = [_one(tiny_model_fp32, SEEDED, 60, REPEATING, speculative="ngram").tokens[1] for _ in range(2)]
    assert runs[0] == runs[1] == _one(tiny_model_fp32, SEEDED, 60, REPEATING).tokens[1]


def test_the_kv_left_behind_is_the_kv_without_speculation(tiny_model_fp32, monkeypatch):
    """With spoiled drafts trimmed off after most steps, the finished row's KV (as the prompt
    cache stores it: its prompt and answer) holds the same keys and values as without
    speculation."""

    def stored(run_actor: Actor) -> list[Any]:
        _serve(run_actor, {0: [Submit(1, PROMPT, 40, GREEDY, frozenset())]})
        entries = run_actor._reuse.cache.entries()
        assert len(entries) == 1 and len(entries[0].key) >= len(PROMPT) + 39
        return entries[0].layers

    plain = _actor(tiny_model_fp32, prompt_cache_gb=0.1)
    plain._open_cache()
    base = _one(tiny_model_fp32, GREEDY, 40)
    _oracle(monkeypatch, base.tokens[1], spoil=0.7)
    spec = _actor(tiny_model_fp32, prompt_cache_gb=0.1, speculative="ngram", num_draft_tokens=6)
    spec._open_cache()
    for a, b in zip(stored(plain), stored(spec), strict=True):
        assert a.keys.shape == b.keys.shape
        assert np.allclose(np.array(a.keys), np.array(b.keys), atol=1e-4)
        assert np.allclose(np.array(a.values), np.array(b.values), atol=1e-4)


def test_a_stop_token_or_max_tokens_inside_the_drafts_ends_the_sequence_there(tiny_model_fp32, monkeypatch):
    """A stop token among kept drafts ends the sequence with it; the kept drafts after it are
    dropped. With drafts past max_tokens allowed (the drafter's own bound taken away), the
    finish rule still ends the sequence at its max_tokens-th token."""
    base = _one(tiny_model_fp32, GREEDY, 48)
    answer = base.tokens[1]
    stop = next(t for t in answer[10:] if answer.index(t) >= 10)  # its first occurrence is past token 10
    at = answer.index(stop)
    _oracle(monkeypatch, answer)
    spec = _one(tiny_model_fp32, GREEDY, 48, stops=frozenset({stop}), speculative="ngram", num_draft_tokens=8)
    assert spec.tokens[1] == answer[: at + 1] and spec.reasons[1] == "stop"
    monkeypatch.setattr(_drafting, "room", lambda k, max_tokens, generated: k)
    spec = _one(tiny_model_fp32, GREEDY, 21, speculative="ngram", num_draft_tokens=8)
    assert spec.tokens[1] == answer[:21] and spec.reasons[1] == "length"
    assert sum(d for _, d, _ in spec.speculated) > sum(a for _, _, a in spec.speculated)


def test_an_abort_between_speculative_steps_ends_the_row(tiny_model_fp32, monkeypatch):
    base = _one(tiny_model_fp32, GREEDY, 48)
    _oracle(monkeypatch, base.tokens[1])
    actor = _actor(tiny_model_fp32, speculative="ngram", num_draft_tokens=4)
    run = _serve(actor, {0: [Submit(1, PROMPT, 48, GREEDY, frozenset())], 3: [Abort(1)]}, steps=6)
    assert 0 < len(run.tokens[1]) < 48 and run.tokens[1] == base.tokens[1][: len(run.tokens[1])]
    assert not actor.schedule.seqs and not actor._bg._generation_batch.uids  # type: ignore[union-attr]


def test_a_batch_whose_speculative_steps_give_less_than_its_plain_steps_stops_speculating(tiny_model_fp32, monkeypatch):
    """Two rows speculating side by side (oracle drafts, every one kept) are judged by time
    against the plain steps of a batch as wide: each row by the tokens it got (`RowSpec`),
    the width by what the batch got (`WidthJudge`). Where plain steps cost (next to)
    nothing, the batch stops after one window of speculative steps and its width waits
    WIDTH_BACKOFF steps, past the rows' end; where they cost forever, it goes on. The
    tokens are the same either way."""
    from trio_mlx.actor._speculate import WIDTH_BACKOFF, WIDTH_WINDOW

    rows = [(0, 1, PROMPT, 48, GREEDY), (0, 2, PROMPT[3:], 48, GREEDY)]
    script = _mixed_script(rows)
    base = _plain(tiny_model_fp32, script)
    _oracles(monkeypatch, {p: base.tokens[rid] for _, rid, p, _, _ in rows})
    widths: list[int] = []
    judged = _judged(monkeypatch)

    def run(plain: float) -> Run:
        monkeypatch.setattr(Decoder, "plain_step", lambda self, width: widths.append(width) or plain)
        return _serve(_actor(tiny_model_fp32, speculative="ngram", num_draft_tokens=1), script)

    slow = run(1e9)
    assert set(judged) == {1e9}  # each row of the two judged against the batch's plain steps
    instant = run(1e-9)
    assert slow.tokens == instant.tokens == base.tokens
    assert set(widths) == {2}  # asked of the batch of two alone
    assert WIDTH_BACKOFF > 48
    for rid in (1, 2):
        goes_on = sum(1 for r, _, _ in _spec_in_batches(slow) if r == rid)
        stopped = sum(1 for r, _, _ in _spec_in_batches(instant) if r == rid)
        assert goes_on > 2 * WIDTH_WINDOW, (rid, goes_on)
        assert stopped == WIDTH_WINDOW, (rid, stopped)


def test_a_batch_wider_than_speculative_max_rows_does_not_speculate_and_a_row_left_alone_does(tiny_model_fp32):
    """Two greedy rows on repeating prompts with speculative_max_rows 1: no speculative step
    while both decode; once the short one has ended, its row leaves at the next step (not
    after retire_steps), and the other speculates. Both outputs are what each makes alone."""
    short, long = Submit(1, LOOPING, 8, GREEDY, frozenset()), Submit(2, LOOPING[1:], 60, GREEDY, frozenset())
    alone = {rid: _one(tiny_model_fp32, GREEDY, s.max_tokens, s.prompt).tokens[1] for rid, s in ((1, short), (2, long))}
    actor = _actor(tiny_model_fp32, speculative="ngram", speculative_max_rows=1)
    run = _serve(actor, {0: [short, long]})
    assert run.tokens[1] == alone[1] and run.tokens[2] == alone[2]
    assert run.speculated and all(rid == 2 for rid, _, _ in run.speculated)
    assert min(run.spec_steps) > run.last[1]  # none while both decoded
    assert run.rows[run.last[1]] == 2 and run.rows[run.last[1] + 1] == 1


def test_a_constrained_row_near_its_budget_does_not_speculate_and_stays_valid(tiny_model_fp32):
    """A JSON string in 24 tokens: the row is in its budget's endgame from the start (its
    completion measured every step), where a constrained row drafts nothing."""
    from trio_mlx.actor._constrain import json_string_grammar, model_vocab

    grammar = Grammar(source=json_string_grammar(), min_tokens=2, kind="json_schema")
    stops = frozenset(model_vocab(tiny_model_fp32).eos)
    actor = _actor(tiny_model_fp32, speculative="ngram")
    run = _serve(actor, {0: [Submit(1, REPEATING, 24, SamplingParams(temperature=1.0, seed=2), stops, grammar)]})
    assert not run.speculated
    from trio_mlx import models

    text = models.load_tokenizer(tiny_model_fp32).decode([t for t in run.tokens[1] if t not in stops])
    assert isinstance(json.loads(text), str), text


def test_the_verifier_draws_each_position_as_a_plain_step_would():
    """On synthetic logits: `Decoder.verify`'s token at position i for a seeded row is the
    token a plain step draws from the same logits with the row's step count advanced by i;
    over many seeds the first position's tokens follow the row's distribution."""
    logits = np.array([[2.0, 1.4, 1.1, 0.6, 0.0, -0.4, -1.0, -1.6]] * 3, dtype=np.float32)
    logits[1] = logits[1][::-1]
    sp = SamplingParams(temperature=1.0, top_k=6)
    counts = np.zeros(8)
    for seed in range(600):
        row = DecodeRow(SamplingParams(**{**_fields(sp), "seed": seed}), (0,))
        sampled, _ = Decoder().verify(mx.array(logits), row, mx.array([1, 2]))
        spec = sampled.tolist()
        for i in range(3):
            plain = DecodeRow(row.sampling, (0,))
            plain.steps = i
            token, _ = Decoder().step(mx.array(logits[i : i + 1]), [plain], mx.array([0]), False)
            assert spec[i] == token.tolist()[0], (seed, i)
        counts[spec[0]] += 1
    p = np.exp(logits[0] - logits[0].max())
    p[np.argsort(logits[0])[:2]] = 0.0  # top_k 6 of 8
    p /= p.sum()
    live = p > 0
    assert counts[~live].sum() == 0
    stat = float(((counts[live] - 600 * p[live]) ** 2 / (600 * p[live])).sum())
    assert stat < 25.0  # chi-square, 5 degrees of freedom: p ~ 1e-4


def _fields(sp: SamplingParams) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(sp, f.name) for f in dataclasses.fields(sp)}


# -- a draft model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random model of the same shape and tokenizer as the tiny one, other weights: it
    drafts what the target almost never makes."""
    from trio_mlx.models import _test_models

    return _test_models.build_test_model(tmp_path_factory.mktemp("draft") / "model", dtype="float32", seed=1)


@pytest.mark.parametrize("sp", [GREEDY, EVERYTHING], ids=["greedy", "penalties-logprobs"])
def test_a_draft_model_keeps_outputs_a_copy_of_the_target_is_always_right_and_another_seldom(
        tiny_model_fp32, other_draft, sp):
    base = _one(tiny_model_fp32, sp, 60)
    same = _one(tiny_model_fp32, sp, 60, draft_model=str(tiny_model_fp32))
    other = _one(tiny_model_fp32, sp, 60, draft_model=str(other_draft))
    assert same.tokens[1] == other.tokens[1] == base.tokens[1]
    if sp.logprobs:
        for run in (same, other):
            for (a, _), (b, _) in zip(run.logprobs[1], base.logprobs[1], strict=True):
                assert a == pytest.approx(b, abs=1e-4)
    if sp.greedy:  # the copy drafts the target's own argmax: every draft kept, K+1 tokens a step
        assert sum(d for _, d, _ in same.speculated) == sum(a for _, _, a in same.speculated) > 40
        assert same.steps < base.steps // 3
    drafted = sum(d for _, d, _ in other.speculated)
    assert sum(a for _, _, a in other.speculated) <= drafted // 4
    assert drafted < 60 * 4 // 2  # the policy stopped it for a while


def test_a_row_that_always_has_drafts_is_judged_against_timed_plain_steps(tiny_model_fp32, monkeypatch):
    """A draft model drafts at every step, so a lone row would never take a plain step, and
    its speculative steps were judged by acceptance alone however slow (a copy of the target
    kept every draft while costing more than plain steps). Its width first takes plain steps
    until one is timed, and each speculative step is judged against it: where plain steps
    cost next to nothing, the row stops speculating after one window of its steps (a batch
    of one row is left to the row's own judgement, `RowSpec`); the tokens are the same
    either way."""
    from trio_mlx.actor._speculate import BACKOFF, WINDOW

    monkeypatch.undo()  # the module's `_untimed`: here the steps are timed
    base = _one(tiny_model_fp32, GREEDY, 48)
    judged = _judged(monkeypatch)
    timed = Decoder.timed_plain
    monkeypatch.setattr(Decoder, "timed_plain", lambda self, width, seconds: timed(self, width, 1e-9))
    run = _one(tiny_model_fp32, GREEDY, 48, draft_model=str(tiny_model_fp32), num_draft_tokens=2)
    assert run.tokens[1] == base.tokens[1]
    assert judged and None not in judged  # every speculative step judged against a timed plain step
    assert run.spec_steps and run.spec_steps[0] >= 2  # the first plain step after the prefill is timed
    assert len(run.speculated) == WINDOW  # then the row stopped, for longer than it had left
    assert sum(1 + a for _, _, a in run.speculated) + BACKOFF > 48


def test_the_draft_models_kv_is_trimmed_to_the_rows_tokens(tiny_model_fp32, other_draft):
    """Mid-generation, the draft model's cache for the row holds exactly the keys and values a
    fresh forward of the row's tokens gives, however many of its drafts were rejected."""
    from mlx_lm.models.cache import make_prompt_cache

    from trio_mlx import models

    actor = _actor(tiny_model_fp32, draft_model=str(other_draft), num_draft_tokens=3)
    run = _serve(actor, {0: [Submit(1, PROMPT, 60, SamplingParams(temperature=1.0, seed=5), frozenset())]}, steps=5)
    assert run.speculated and len(run.tokens[1]) < 60
    batch: Any = actor._bg._generation_batch  # type: ignore[union-attr]
    state = batch.samplers[0].spec.draft
    held = batch.tokens[0][: state.held]
    assert len(PROMPT) < state.held <= len(batch.tokens[0])  # at most what the row's own KV holds
    model, _ = models.load_model(other_draft)
    fresh = make_prompt_cache(model)
    model(mx.array(held)[None], cache=fresh)
    for a, b in zip(state.cache, fresh, strict=True):
        assert a.offset == b.offset == len(held)
        assert np.allclose(np.array(a.keys[..., : a.offset, :]), np.array(b.keys[..., : b.offset, :]), atol=1e-4)
        assert np.allclose(np.array(a.values[..., : a.offset, :]), np.array(b.values[..., : b.offset, :]), atol=1e-4)


class _Sizes:
    """A draft model that records the batch size of each forward it runs."""

    def __init__(self, model: Any):
        self.model, self.sizes = model, []

    def __call__(self, x: Any, cache: Any = None) -> Any:
        self.sizes.append(x.shape[0])
        return self.model(x, cache=cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


@pytest.mark.parametrize("cuda_attention", [False, True])
@pytest.mark.parametrize("draft", ["copy", "other"])
def test_a_draft_model_drafts_for_the_rows_of_a_batch_in_one_forward(tiny_model_fp32, other_draft, monkeypatch,
                                                                      draft, cuda_attention):
    """Rows that speculate side by side (entering and leaving at different steps, greedy and
    seeded) draft in one batch of draft forwards, their caches joined and split back: every
    row's tokens are those without speculation; a copy of the target has every draft kept.
    Also with the draft's attention over a few queries as matmuls, as on CUDA."""
    if cuda_attention:
        monkeypatch.setattr(_drafting, "prefill_grid", lambda: True)
    rows = [(0, 1, PROMPT, 40, GREEDY), (0, 2, _random_prompt(1), 30, SEEDED),
            (5, 3, PROMPT[4:], 36, GREEDY), (9, 4, _random_prompt(2, 20), 18, EVERYTHING)]
    script = _mixed_script(rows)
    base = _plain(tiny_model_fp32, script)
    actor = _actor(tiny_model_fp32, draft_model=str(tiny_model_fp32 if draft == "copy" else other_draft),
                   num_draft_tokens=3)
    assert actor._drafter is not None and actor._drafter.few_as_matmuls == cuda_attention
    spy = actor._drafter.model = _Sizes(actor._drafter.model)
    run = _serve(actor, script)
    for _, rid, _, max_tokens, _ in rows:
        assert run.tokens[rid] == base.tokens[rid] and len(run.tokens[rid]) == max_tokens, rid
    assert max(spy.sizes) >= 3  # three rows or more drafted in one forward
    shared = _spec_in_batches(run)
    if draft == "copy":
        greedy = [(d, a) for rid, d, a in shared if rid in (1, 3)]
        assert greedy and all(d == a for d, a in greedy)  # the target's own argmax, every draft kept


@pytest.mark.parametrize("rows", [1, 3])
def test_a_draft_model_fills_a_long_history_in_chunks(tiny_model_fp32, rows):
    """A row's first speculation feeds the draft model its whole history, in chunks of the
    prefill step (here 8 tokens, the prompts 27-35): alone and side by side, the tokens are
    those without speculation, and a copy of the target keeps every greedy draft."""
    script = {0: [Submit(i + 1, PROMPT[i * 4 :], 30, GREEDY, frozenset()) for i in range(rows)]}
    base = _serve(_actor(tiny_model_fp32, prefill_step=8), script)
    run = _serve(_actor(tiny_model_fp32, prefill_step=8, draft_model=str(tiny_model_fp32), num_draft_tokens=3),
                 script)
    assert run.tokens == base.tokens
    assert run.speculated and all(d == a for _, d, a in run.speculated)


def test_filling_a_rows_history_into_the_draft_model_is_not_judged_as_its_steps_cost(tiny_model_fp32, monkeypatch):
    """A row's first speculation feeds the draft model its whole prompt (an agent's: thousands
    of tokens), once: judged as part of that step, it stopped a draft that pays at every step
    after. Here the fill takes a second and plain steps 50 ms; a copy of the target gives 4
    tokens a speculative step, far faster than plain steps, and the row goes on speculating."""
    import time

    from trio_mlx.actor._speculate import WIDTH_WINDOW

    class SlowFill(_Sizes):
        def __call__(self, x: Any, cache: Any = None) -> Any:
            if x.shape[1] == 8:  # a chunk of the history (the prefill step), never a draft's input
                time.sleep(0.25)
            return super().__call__(x, cache)

    monkeypatch.setattr(Decoder, "plain_step", lambda self, width: 0.05)
    judged = _judged(monkeypatch)
    actor = _actor(tiny_model_fp32, draft_model=str(tiny_model_fp32), num_draft_tokens=3, prefill_step=8)
    spy = actor._drafter.model = SlowFill(actor._drafter.model)  # type: ignore[union-attr]
    run = _serve(actor, {0: [Submit(1, PROMPT, 48, GREEDY, frozenset())]})
    assert spy.sizes.count(1) >= 4  # the history's four chunks, a second in all
    assert judged and set(judged) == {0.05}  # the steps were judged, against the plain steps' time
    assert len(run.speculated) > WIDTH_WINDOW  # not stopped after its first window
    assert all(d == a for _, d, a in run.speculated)


def test_a_batchs_draft_caches_hold_each_rows_tokens(tiny_model_fp32, other_draft):
    """Mid-generation, after steps that drafted for two rows in one batch and kept different
    counts of their drafts, each row's draft cache holds exactly the keys and values a fresh
    forward of that row's tokens gives."""
    from mlx_lm.models.cache import make_prompt_cache

    from trio_mlx import models

    actor = _actor(tiny_model_fp32, draft_model=str(other_draft), num_draft_tokens=3)
    spy = actor._drafter.model = _Sizes(actor._drafter.model)  # type: ignore[union-attr]
    script = {0: [Submit(1, PROMPT, 60, SamplingParams(temperature=1.0, seed=5), frozenset()),
                  Submit(2, PROMPT[7:], 60, SamplingParams(temperature=1.0, seed=6), frozenset())]}
    run = _serve(actor, script, steps=6)
    assert 2 in spy.sizes and len(_spec_in_batches(run)) >= 4
    batch: Any = actor._bg._generation_batch  # type: ignore[union-attr]
    model, _ = models.load_model(other_draft)
    for i in range(2):
        state = batch.samplers[i].spec.draft
        held = batch.tokens[i][: state.held]
        assert len(PROMPT) - 7 < state.held <= len(batch.tokens[i])
        fresh = make_prompt_cache(model)
        model(mx.array(held)[None], cache=fresh)
        for a, b in zip(state.cache, fresh, strict=True):
            assert a.offset == b.offset == len(held)
            assert np.allclose(np.array(a.keys[..., : a.offset, :]), np.array(b.keys[..., : b.offset, :]), atol=1e-4)
            assert np.allclose(np.array(a.values[..., : a.offset, :]), np.array(b.values[..., : b.offset, :]),
                               atol=1e-4)


def _given(sdpa: Any, masks: list[Any], *args: Any, mask: Any = None, **kwargs: Any) -> Any:
    masks.append(mask)
    return sdpa(*args, mask=mask, **kwargs)


@pytest.mark.parametrize("scratch", ["ample", "runs", "none"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)])
@pytest.mark.parametrize("queries", [5, MAX_DRAFT + 1])
def test_attention_with_few_queries_is_the_fused_attention(queries, heads, scratch, monkeypatch):
    """`_shapes.few_queries` (a speculative step's attention on CUDA): a few queries behind a
    KV, causal or with an array mask (left padding, boolean or additive, per row or per
    head, or one row for every query), attend as matmuls and give what the fused attention gives, without calling it;
    up to the widest step a tuning allows (the most drafts and the pending token), where
    cuDNN would build a graph per key length. Where the scores would pass FEW_SCRATCH, in
    runs of queries whose scores fit, as matmuls; where not even two fit, one query at a
    time through the fused attention of one query; the same. Unmasked calls go through to it."""
    from mlx_lm.models import base as mlx_lm_base

    from trio_mlx.actor import _shapes
    from trio_mlx.actor._shapes import few_queries

    keys, (h, kv) = queries + 7, heads
    if scratch == "none":
        monkeypatch.setattr(_shapes, "FEW_SCRATCH", 0)
    elif scratch == "runs":  # three queries' scores (two rows, h heads, every key) at a time
        monkeypatch.setattr(_shapes, "FEW_SCRATCH", 3 * 2 * h * keys * 4)

    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32))
               for s in ((2, h, queries, 8), (2, kv, keys, 8), (2, kv, keys, 8)))
    padded = np.broadcast_to(np.tril(np.ones((queries, keys), dtype=bool), k=7), (2, 1, queries, keys)).copy()
    padded[0, :, :, :3] = False  # row 0: three positions of left padding
    per_head = np.broadcast_to(padded, (2, h, queries, keys)).copy()
    per_head[1, 1, :, :2] = False
    additive = np.where(padded, 0.0, -1e9).astype(np.float32)
    one_row = mx.array(padded[:, :, -1:, :])  # the same row of the mask for every query
    for mask in ("causal", None, mx.array(padded), mx.array(per_head), mx.array(additive), one_row):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
        sdpa = mx.fast.scaled_dot_product_attention
        masks: list[Any] = []
        mx.fast.scaled_dot_product_attention = functools.partial(_given, sdpa, masks)
        try:
            with few_queries():  # called as mlx_lm's models call it (sinks=None)
                got = mlx_lm_base.scaled_dot_product_attention(q, k, v, cache=None, scale=0.3, mask=mask)
        finally:
            mx.fast.scaled_dot_product_attention = sdpa
        if mask is None:
            assert len(masks) == 1  # through to the fused attention, as it is
        elif scratch in ("ample", "runs"):
            assert not masks  # matmuls
        else:
            assert len(masks) == queries and all(m is None or m.shape[-2] == 1 for m in masks)  # one at a time
        assert got.shape == want.shape
        assert np.allclose(np.array(got), np.array(want), atol=1e-5), mask
    with few_queries(False):
        assert mx.fast.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"


def test_attention_as_matmuls_keeps_the_queries_type():
    """`_shapes.attention` over bf16 queries, keys and values (a served model's) gives bf16, as
    the fused attention does, with a boolean mask or an additive one of another type."""
    from trio_mlx.actor._shapes import attention

    rng = np.random.default_rng(1)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(mx.bfloat16)
               for s in ((2, 4, 5, 8), (2, 2, 12, 8), (2, 2, 12, 8)))
    keep = mx.array(np.tril(np.ones((5, 12), dtype=bool), k=7))[None, None]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=keep).astype(mx.float32)
    for mask in (keep, mx.where(keep, 0.0, -1e9).astype(mx.float32)):
        got = attention(q, k, v, 0.3, mask)
        assert got.dtype == mx.bfloat16
        assert np.allclose(np.array(got.astype(mx.float32)), np.array(want), atol=0.05)


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_speculative_steps_attending_as_on_cuda_keep_their_tokens(tiny_model_fp32, monkeypatch, drafter):
    """Speculation as it runs on CUDA (the verify's and the draft model's attention over a
    few queries as matmuls): the same greedy tokens as no speculation, the copy's drafts all
    kept."""
    from trio_mlx.actor import _batch, _drafting

    real = _batch.few_queries
    used: list[bool] = []

    def forced(on: bool = True) -> Any:
        used.append(on)
        return real(True)

    monkeypatch.setattr(_batch, "few_queries", forced)
    monkeypatch.setattr(_drafting, "few_queries", forced)
    base = _one(tiny_model_fp32, GREEDY, 60, LOOPING)
    tuning = {"speculative": "ngram"} if drafter == "ngram" else {"draft_model": str(tiny_model_fp32)}
    run = _one(tiny_model_fp32, GREEDY, 60, LOOPING, **tuning)
    assert run.tokens[1] == base.tokens[1]
    kept = sum(a for _, _, a in run.speculated)
    assert used and kept > 0
    if drafter == "draft":
        assert sum(d for _, d, _ in run.speculated) == kept > 40


async def test_an_engine_with_a_draft_model_serves_the_same_text_and_counts_its_drafts(tiny_model_fp32, embedded_model):
    import trio_mlx

    async def answer(**options: Any) -> tuple[str, Any]:
        async with trio_mlx.open_engine(tiny_model_fp32, warmup=False, **options) as engine:
            async with engine.generate("The quick brown fox", max_tokens=24, temperature=0.0,
                                       ignore_eos=True) as events:
                text = ""
                async for ev in events:
                    if isinstance(ev, trio_mlx.TextDelta):
                        text += ev.text
                    else:
                        return text, ev.usage
        raise AssertionError("no Finished")

    plain, usage = await answer()
    assert usage.draft_tokens == 0
    drafted, usage = await answer(draft_model=str(tiny_model_fp32), num_draft_tokens=3)
    assert drafted == plain and usage.accepted_draft_tokens == usage.draft_tokens > 0
    with pytest.raises(trio_mlx.ModelLoadError, match="another tokenizer"):
        await answer(draft_model=str(embedded_model))


# -- speculation in a batch (`_spec_step.py`) -------------------------------------------


def _random_prompt(seed: int, n: int = 30) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 250) for _ in range(n))


def _oracles(monkeypatch: pytest.MonkeyPatch, answers: dict[tuple[int, ...], list[int]], spoil: float = 0.0,
             seed: int = 0, default: list[int] | None = None) -> None:
    """`_oracle` for several rows, each known by its prompt; a row whose prompt is not in
    `answers` drafts from `default`, or never has drafts (a plain row of the batch's
    speculative steps) without one."""
    rng = random.Random(seed)

    def lookup(self: Any, row: DecodeRow, spec: Any, held: list[int], pending: Any, k: int) -> Proposal | None:
        answer = answers.get(row.prompt, default)
        if answer is None:
            return None
        first = int(pending.item())
        out = len(held) - len(row.prompt)  # tokens out so far: `first` is the next
        assert first == answer[out]
        drafts = list(answer[out + 1 : out + 1 + k]) or [7]
        if rng.random() < spoil:
            j = rng.randrange(len(drafts))
            drafts[j] = 3 + (drafts[j] + 1) % 90
        inputs = mx.array([[first, *drafts]], dtype=pending.dtype)
        return Proposal(inputs, inputs[0, 1:], first, drafts, len(held))

    monkeypatch.setattr(_drafting.Drafter, "_lookup", lookup)


def _spec_in_batches(run: Run) -> list[tuple[int, int, int]]:
    """The (rid, drafted, kept) of speculative steps taken by a batch of two rows or more."""
    by_step = collections.Counter(run.spec_steps)
    return [s for s, k in zip(run.speculated, run.spec_steps, strict=True) if by_step[k] > 1 or run.rows[k] > 1]


def _mixed_script(rows: list[tuple[int, int, tuple[int, ...], int, SamplingParams]]) -> dict[int, list[Any]]:
    script: dict[int, list[Any]] = collections.defaultdict(list)
    for step, rid, prompt, max_tokens, sp in rows:
        script[step].append(Submit(rid, prompt, max_tokens, sp, frozenset()))
    return dict(script)


MIXED = [(0, 1, LOOPING, 40, GREEDY), (0, 2, _random_prompt(1), 30, GREEDY),
         (5, 3, LOOPING[3:], 50, GREEDY), (9, 4, _random_prompt(2, 20), 18, GREEDY)]


@pytest.mark.parametrize("cuda_attention", [False, True])
def test_prompt_lookup_in_a_mixed_batch_keeps_every_rows_greedy_tokens(tiny_model_fp32, monkeypatch, cuda_attention):
    """The real drafter, a batch of rows that repeat their prompts (drafts found) and rows on
    random prompts, entering and leaving at different steps: every row's tokens are those
    without speculation, and rows speculate while they share the batch, some drafts kept.
    Also with the verify's attention as matmuls, as on CUDA (padded rows too)."""
    if cuda_attention:
        from trio_mlx.actor import _batch

        real, used = _batch.few_queries, []
        monkeypatch.setattr(_batch, "few_queries", lambda on=True: used.append(on) or real(True))
    script = _mixed_script(MIXED)
    base = _plain(tiny_model_fp32, script)
    run = _serve(_actor(tiny_model_fp32, speculative="ngram"), script)
    for _, rid, _, max_tokens, _ in MIXED:
        assert run.tokens[rid] == base.tokens[rid] and len(run.tokens[rid]) == max_tokens, rid
    shared = _spec_in_batches(run)
    assert shared and sum(a for _, _, a in shared) > 0
    assert run.steps < base.steps
    if cuda_attention:
        assert len(used) >= len(set(run.spec_steps))  # every verify took the CUDA path


@pytest.mark.parametrize("spoil", [0.0, 0.5])
def test_drafts_verified_beside_plain_rows_keep_tokens_and_logprobs(tiny_model_fp32, monkeypatch, spoil):
    """Oracle drafts (all right, or spoiled at random: rows of one step keep different
    counts, their KV rolled back by each its own) for greedy, seeded and penalized rows with
    logprobs, beside rows that never draft, entering at different steps: every row's tokens
    and logprobs are those without speculation."""
    rows = [(0, 1, PROMPT, 40, GREEDY), (0, 2, _random_prompt(3), 30, SEEDED), (2, 3, PROMPT[4:], 36, EVERYTHING),
            (4, 4, _random_prompt(4), 24, EVERYTHING), (6, 5, REPEATING, 30, SEEDED)]
    script = _mixed_script(rows)
    base = _plain(tiny_model_fp32, script)
    _oracles(monkeypatch, {p: base.tokens[rid] for _, rid, p, _, _ in rows if rid in (1, 3, 5)}, spoil)
    run = _serve(_actor(tiny_model_fp32, speculative="ngram", num_draft_tokens=5), script)
    for _, rid, _, _, sp in rows:
        assert run.tokens[rid] == base.tokens[rid], rid
        if sp.logprobs:
            for (a, top_a), (b, top_b) in zip(run.logprobs[rid], base.logprobs[rid], strict=True):
                assert a == pytest.approx(b, abs=1e-4)
                assert [t for t, _ in top_a] == [t for t, _ in top_b]
    shared = _spec_in_batches(run)
    assert {rid for rid, _, _ in shared} == {1, 3, 5}
    drafted, kept = sum(d for _, d, _ in shared), sum(a for _, _, a in shared)
    assert (kept == drafted > 0) if spoil == 0.0 else (0 < kept < drafted)


def test_no_speculative_step_holds_back_a_first_token(tiny_model_fp32, monkeypatch):
    """A row with drafts at every step (oracle, every one kept) speculates; a request that
    arrives beside it waits for no speculative step: from the step that inserts it to the
    one that reports its first token (its prefill, the step that samples it, the one that
    reports it) the batch takes plain steps, which are pipelined and cost less. After that
    the row speculates again, and every token is the one without speculation."""
    rows = [(0, 1, PROMPT, 60, GREEDY), (6, 2, _random_prompt(5), 12, GREEDY)]
    script = _mixed_script(rows)
    base = _plain(tiny_model_fp32, script)
    _oracles(monkeypatch, {PROMPT: base.tokens[1]})
    run = _serve(_actor(tiny_model_fp32, speculative="ngram", num_draft_tokens=2), script)
    assert run.tokens == base.tokens
    assert 6 in range(run.first[1] + 1, run.last[1])  # it arrived while the first row decoded
    assert {k for k in run.spec_steps if k < 6}  # which speculated
    assert not {k for k in run.spec_steps if 6 <= k <= run.first[2]}, (run.spec_steps, run.first[2])
    assert {k for k in run.spec_steps if k > run.first[2]}  # and speculates again after


def test_a_seeded_row_in_a_speculating_batch_is_reproducible(tiny_model_fp32):
    """Prompt lookup for a seeded row beside a greedy one: the same tokens run after run, and
    as without speculation."""
    script = _mixed_script([(0, 1, REPEATING, 50, SEEDED), (0, 2, LOOPING[2:], 50, GREEDY)])
    runs = [_serve(_actor(tiny_model_fp32, speculative="ngram"), script) for _ in range(2)]
    base = _plain(tiny_model_fp32, script)
    assert runs[0].tokens == runs[1].tokens == base.tokens
    assert _spec_in_batches(runs[0])


def test_the_kv_a_batch_leaves_behind_is_the_kv_without_speculation(tiny_model_fp32, monkeypatch):
    """Rows of one batch keeping different counts of spoiled drafts, beside a row that never
    drafts: what the prompt cache stores for each (its prompt and answer) holds the same keys
    and values as without speculation."""
    rows = [(0, 1, PROMPT, 40, GREEDY), (0, 2, _random_prompt(5), 34, GREEDY), (0, 3, PROMPT[6:], 44, GREEDY)]
    script = _mixed_script(rows)

    def stored(actor: Actor) -> tuple[Run, dict[tuple[int, ...], list[Any]]]:
        actor._open_cache()
        run = _serve(actor, script)
        entries = actor._reuse.cache.entries()
        assert len(entries) == 3
        return run, {tuple(e.key): e.layers for e in entries}

    base, plain = stored(_actor(tiny_model_fp32, prompt_cache_gb=0.1))
    _oracles(monkeypatch, {PROMPT: base.tokens[1], PROMPT[6:]: base.tokens[3]}, spoil=0.7, seed=2)
    run, spec = stored(_actor(tiny_model_fp32, prompt_cache_gb=0.1, speculative="ngram", num_draft_tokens=6))
    assert _spec_in_batches(run) and run.tokens == base.tokens
    assert spec.keys() == plain.keys()
    for key, layers in plain.items():
        for a, b in zip(layers, spec[key], strict=True):
            assert a.keys.shape == b.keys.shape
            assert np.allclose(np.array(a.keys), np.array(b.keys), atol=1e-4)
            assert np.allclose(np.array(a.values), np.array(b.values), atol=1e-4)


def test_a_stop_token_or_max_tokens_inside_a_batch_rows_drafts_ends_it_there(tiny_model_fp32, monkeypatch):
    """In a batch: a stop token among one row's kept drafts ends that row with it; with drafts
    past max_tokens allowed, another row still ends at its max_tokens-th token; a third row,
    never drafting, is unchanged."""
    rows = [(0, 1, PROMPT, 48, GREEDY), (0, 2, PROMPT[3:], 48, GREEDY), (0, 3, _random_prompt(6), 40, GREEDY)]
    base = _plain(tiny_model_fp32, _mixed_script(rows))
    answer = base.tokens[1]
    stop = next(t for t in answer[10:] if answer.index(t) >= 10)
    at = answer.index(stop)
    _oracles(monkeypatch, {PROMPT: answer, PROMPT[3:]: base.tokens[2]})
    monkeypatch.setattr(_drafting, "room", lambda k, max_tokens, generated: k)
    script = {0: [Submit(1, PROMPT, 48, GREEDY, frozenset({stop})), Submit(2, PROMPT[3:], 21, GREEDY, frozenset()),
                  Submit(3, _random_prompt(6), 40, GREEDY, frozenset())]}
    run = _serve(_actor(tiny_model_fp32, speculative="ngram", num_draft_tokens=8), script)
    assert run.tokens[1] == answer[: at + 1] and run.reasons[1] == "stop"
    assert run.tokens[2] == base.tokens[2][:21] and run.reasons[2] == "length"
    assert run.tokens[3] == base.tokens[3] and run.reasons[3] == "length"
    shared = _spec_in_batches(run)
    assert {1, 2} <= {rid for rid, _, _ in shared}


def test_an_abort_in_a_speculating_batch_ends_that_row_alone(tiny_model_fp32, monkeypatch):
    rows = [(0, 1, PROMPT, 40, GREEDY), (0, 2, PROMPT[2:], 40, GREEDY), (0, 3, _random_prompt(7), 40, GREEDY)]
    script = _mixed_script(rows)
    base = _plain(tiny_model_fp32, script)
    _oracles(monkeypatch, {PROMPT: base.tokens[1], PROMPT[2:]: base.tokens[2]}, spoil=0.3)
    actor = _actor(tiny_model_fp32, speculative="ngram", num_draft_tokens=4)
    run = _serve(actor, {**script, 3: [Abort(2)]})
    assert 0 < len(run.tokens[2]) < 40 and run.tokens[2] == base.tokens[2][: len(run.tokens[2])]
    assert 2 not in run.reasons
    assert run.tokens[1] == base.tokens[1] and run.tokens[3] == base.tokens[3]
    assert any(k <= 3 for k in run.spec_steps) and any(k > 4 for k in run.spec_steps)
    assert not actor.schedule.seqs


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "ids": {"type": "array", "items": {"type": "integer"}}},
          "required": ["name", "ids"], "additionalProperties": False}
NUMBERS = {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"}}},
           "required": ["ids"], "additionalProperties": False}


def _constrained(path: Path, rid: int, prompt: tuple[int, ...], max_tokens: int, sp: SamplingParams,
                 schema: dict[str, Any]) -> tuple[Submit, frozenset[int]]:
    import llguidance

    from trio_mlx.actor._constrain import model_vocab
    from trio_mlx.engine._grammar import JSON_OPTIONS

    source = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    stops = frozenset(model_vocab(path).eos)
    return Submit(rid, prompt, max_tokens, sp, stops, Grammar(source=source, min_tokens=16, kind="json_schema")), stops


def _valid(path: Path, tokens: list[int], stops: frozenset[int], schema: dict[str, Any]) -> None:
    import jsonschema

    from trio_mlx import models

    text = models.load_tokenizer(path).decode([t for t in tokens if t not in stops])
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(("beside", "sp"), [(False, GREEDY), (True, GREEDY), (True, SEEDED)],
                         ids=["alone", "beside-free-rows", "seeded-beside-free-rows"])
@pytest.mark.parametrize("spoil", [0.0, 0.5])
def test_a_constrained_row_speculates_and_keeps_its_tokens(tiny_model_fp32, monkeypatch, beside, sp, spoil):
    """A row held to a JSON schema, alone or beside free rows (one drafting, one never),
    with oracle drafts (all right, or spoiled at random): it speculates, keeps drafts, and
    every row's tokens are those without speculation; the constrained output validates."""
    submit, stops = _constrained(tiny_model_fp32, 1, PROMPT, 480, sp, SCHEMA)  # room to be far from its end
    script: dict[int, list[Any]] = {0: [submit]}
    if beside:
        script[0].append(Submit(2, REPEATING, 60, GREEDY, frozenset()))
        script[3] = [Submit(3, _random_prompt(5), 40, GREEDY, frozenset())]
    base = _plain(tiny_model_fp32, script, 600)
    _oracles(monkeypatch, {PROMPT: base.tokens[1], REPEATING: base.tokens.get(2, [])}, spoil)
    run = _serve(_actor(tiny_model_fp32, speculative="ngram", num_draft_tokens=5), script, 600)
    assert run.tokens == base.tokens and run.reasons == base.reasons
    _valid(tiny_model_fp32, run.tokens[1], stops, SCHEMA)
    mine = [(d, a) for rid, d, a in (_spec_in_batches(run) if beside else run.speculated) if rid == 1]
    drafted, kept = sum(d for d, _ in mine), sum(a for _, a in mine)
    assert (0 < kept) if spoil == 0.0 else (0 < kept < drafted)


def test_a_draft_the_grammar_forbids_is_never_kept(tiny_model_fp32, monkeypatch):
    """A greedy constrained row (integers only) whose logit_bias makes a letter the model's
    choice everywhere, the drafts spoiled with that letter: the grammar forbids it at every
    position, so the masks reject it where the model alone would keep it; the grammar
    stops the drafts there, and the tokens are those without speculation."""
    from trio_mlx import models
    from trio_mlx.actor import _constrain

    letter = models.load_tokenizer(tiny_model_fp32).encode("q", add_special_tokens=False)[-1]
    sp = SamplingParams(temperature=0.0, logit_bias=((letter, 60.0),))
    submit, stops = _constrained(tiny_model_fp32, 1, PROMPT, 480, sp, NUMBERS)
    script = {0: [submit, Submit(2, REPEATING, 60, GREEDY, frozenset())]}
    base = _plain(tiny_model_fp32, script, 600)
    assert letter not in base.tokens[1]
    answer = base.tokens[1]
    rng = random.Random(1)

    def lookup(self: Any, row: DecodeRow, spec: Any, held: list[int], pending: Any, k: int) -> Proposal | None:
        out = len(held) - len(row.prompt)
        first = int(pending.item())
        drafts = list((answer if row.grammar is not None else base.tokens[2])[out + 1 : out + 1 + k]) or [7]
        if row.grammar is not None and rng.random() < 0.6:
            drafts[rng.randrange(len(drafts))] = letter
        inputs = mx.array([[first, *drafts]], dtype=pending.dtype)
        return Proposal(inputs, inputs[0, 1:], first, drafts, len(held))

    cut: list[tuple[list[int], int]] = []
    real = _constrain.GrammarProcessor.draft

    def draft(self: Any, drafts: Any, out: Any) -> int:
        taken = real(self, drafts, out)
        cut.append((list(drafts), taken))
        return taken

    monkeypatch.setattr(_drafting.Drafter, "_lookup", lookup)
    monkeypatch.setattr(_constrain.GrammarProcessor, "draft", draft)
    run = _serve(_actor(tiny_model_fp32, speculative="ngram", num_draft_tokens=5), script, 600)
    assert run.tokens == base.tokens
    _valid(tiny_model_fp32, run.tokens[1], stops, NUMBERS)
    assert sum(a for rid, _, a in run.speculated if rid == 1) > 0
    stopped = [(d, n) for d, n in cut if letter in d]
    assert stopped and all(n <= d.index(letter) for d, n in stopped)
    assert any(n == d.index(letter) for d, n in stopped)


def test_a_draft_model_drafts_for_a_constrained_row(tiny_model_fp32):
    """A copy of the target drafts its unconstrained choices: the grammar stops them at the
    first it forbids, the row keeps the rest where its masked choice agrees, and its tokens
    are those without speculation."""
    submit, stops = _constrained(tiny_model_fp32, 1, PROMPT, 480, GREEDY, SCHEMA)
    base = _plain(tiny_model_fp32, {0: [submit]}, 600)
    run = _serve(_actor(tiny_model_fp32, draft_model=str(tiny_model_fp32)), {0: [submit]}, 600)
    assert run.tokens == base.tokens
    _valid(tiny_model_fp32, run.tokens[1], stops, SCHEMA)
    assert sum(a for _, _, a in run.speculated) > 0


@pytest.mark.parametrize("max_rows", [2, 3])
def test_no_speculation_in_a_batch_wider_than_speculative_max_rows(tiny_model_fp32, max_rows):
    """Three rows on repeating prompts: with speculative_max_rows 2 none speculates until
    the short one has left; with 3 they speculate from the start. The tokens are the same."""
    rows = [(0, 1, LOOPING, 20, GREEDY), (0, 2, LOOPING[1:], 50, GREEDY), (0, 3, LOOPING[2:], 50, GREEDY)]
    script = _mixed_script(rows)
    base = _plain(tiny_model_fp32, script)
    run = _serve(_actor(tiny_model_fp32, speculative="ngram", speculative_max_rows=max_rows), script)
    assert run.tokens == base.tokens and run.speculated
    if max_rows == 2:
        assert min(run.spec_steps) > run.last[1]
    else:
        assert min(run.spec_steps) <= run.last[1]


@pytest.mark.parametrize(("tokens", "stale"), [
    ([[5, 6, 7, 8, 9, 10], [11, 12, 13]], [1, 3]),
    ([[5, 6, 7], [11, 12, 13, 14, 15]], [1, 3]),  # the row that keeps most was padded: padding cut
    ([[5, 6, 7, 8], [11, 12], [20, 21, 22, 23, 24]], [2, 4, 3]),
])
def test_rolling_rows_back_by_different_counts_is_as_if_their_stale_tokens_never_went_in(
        tiny_model_fp32, tokens, stale):
    """`_spec_step.rollback` on a batch's `BatchKVCache`s after every row wrote K+1 tokens: each
    row keeps its own count of them (the rest rolled into its left padding). The next step's
    logits, and each row's keys, offset and left padding, are those of a batch that held only
    the kept tokens."""
    from mlx_lm.models.cache import BatchKVCache

    from trio_mlx import models
    from trio_mlx.actor._spec_step import rollback

    model, _ = models.load_model(tiny_model_fp32)
    layers, k = len(model.layers), 4
    written = [[100 + 10 * r + j for j in range(k + 1)] for r in range(len(tokens))]
    kept = [t + w[: k + 1 - s] for t, w, s in zip(tokens, written, stale, strict=True)]

    def batch(rows: list[list[int]]) -> list[Any]:
        width = max(len(r) for r in rows)
        caches = [BatchKVCache([width - len(r) for r in rows]) for _ in range(layers)]
        model(mx.array([[0] * (width - len(r)) + r for r in rows]), cache=caches)
        return caches

    spec = batch(tokens)
    model(mx.array(written), cache=spec)
    rollback(spec, stale)
    plain = batch(kept)
    then = mx.array([[40 + r] for r in range(len(tokens))])
    a, b = model(then, cache=spec), model(then, cache=plain)
    assert np.allclose(np.array(a), np.array(b), atol=1e-5)
    for x, y in zip(spec, plain, strict=True):
        assert x._idx == y._idx
        assert x.offset.tolist() == y.offset.tolist() and x.left_padding.tolist() == y.left_padding.tolist()
        kx, vx = x.keys_and_values()
        ky, vy = y.keys_and_values()
        for r, p in enumerate(x.left_padding.tolist()):
            assert np.allclose(np.array(kx[r, :, p:]), np.array(ky[r, :, p:]), atol=1e-5)
            assert np.allclose(np.array(vx[r, :, p:]), np.array(vy[r, :, p:]), atol=1e-5)


async def test_requests_sharing_a_batch_count_their_drafts_and_stop_at_their_stop_strings(tiny_model_fp32):
    """Two requests decoding side by side with a draft model (a copy of the target: every
    draft kept, 4 tokens a step): each one's usage counts its drafted and accepted tokens,
    and its text is the one without speculation; with a stop string from the middle of the
    first one's text, that request ends there (the string landing among kept drafts) and
    the other is unchanged."""
    import trio

    import trio_mlx

    prompts = ["The quick brown fox", "The lazy dog sleeps"]

    async def both(stop: str | None = None, **options: Any) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = [("", None), ("", None)]
        async with trio_mlx.open_engine(tiny_model_fp32, warmup=False, **options) as engine:

            async def one(i: int) -> None:
                stops = {"stop": [stop]} if stop is not None and i == 0 else {}
                async with engine.generate(prompts[i], max_tokens=24, temperature=0.0, ignore_eos=True,
                                           **stops) as events:
                    text = ""
                    async for ev in events:
                        if isinstance(ev, trio_mlx.TextDelta):
                            text += ev.text
                        else:
                            out[i] = (text, ev)

            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(one, i)
        return out

    plain = await both()
    drafted = await both(draft_model=str(tiny_model_fp32), num_draft_tokens=3)
    for (text, _), (spec_text, fin) in zip(plain, drafted, strict=True):
        assert spec_text == text
        assert fin.usage.accepted_draft_tokens == fin.usage.draft_tokens > 0
    text = plain[0][0]
    at = next(p for p in range(len(text) // 2, len(text) - 3) if text.find(text[p : p + 3]) == p)
    stopped = await both(text[at : at + 3], draft_model=str(tiny_model_fp32), num_draft_tokens=3)
    assert stopped[0][0] == text[:at] and stopped[0][1].finish_reason == "stop"
    assert stopped[1][0] == plain[1][0] and stopped[1][1].usage.draft_tokens > 0


def test_a_draft_models_step_starts_the_verify_before_reading_its_drafts_back(tiny_model_fp32, monkeypatch):
    """A draft model's drafts are part of the step's graph: the verifying forward is handed to
    the device (async_eval of its logits) before the host reads the drafts back, every
    speculative step, so the device runs it while the host waits (not after a round trip)."""
    from trio_mlx.actor import _spec_step

    started: list[tuple[int, ...]] = []

    class _Mx:
        def __getattr__(self, name: str) -> Any:
            return getattr(mx, name)

        def async_eval(self, *arrays: Any) -> None:
            started.append(tuple(a.shape for a in arrays))
            mx.async_eval(*arrays)

    monkeypatch.setattr(_spec_step, "mx", _Mx())
    run = _one(tiny_model_fp32, GREEDY, 40, draft_model=str(tiny_model_fp32), num_draft_tokens=3)
    assert run.speculated
    assert len(started) == len(set(run.spec_steps))  # once a speculative step: its logits, (rows, K+1, vocab)
    assert all(len(s) == 1 and len(s[0]) == 3 and s[0][1] > 1 for s in started)


def test_rows_in_lockstep_do_not_speculate_beside_each_other_and_a_row_left_alone_does(tiny_model_fp32):
    """Two greedy rows on repeating prompts of one length, entering together: their batch has
    no padding, and a kept draft would give it some for every later step, so neither
    speculates while both decode; once the short one has ended and left, the other does.
    Both outputs are what each makes alone."""
    other = (LOOPING[0] + 1,) + LOOPING[1:]  # as long, not a prefix of it: no wait for its prefill
    short, long = Submit(1, LOOPING, 12, GREEDY, frozenset()), Submit(2, other, 60, GREEDY, frozenset())
    alone = {rid: _one(tiny_model_fp32, GREEDY, s.max_tokens, s.prompt).tokens[1] for rid, s in ((1, short), (2, long))}
    run = _serve(_actor(tiny_model_fp32, speculative="ngram", retire_steps=0), {0: [short, long]})
    assert run.tokens[1] == alone[1] and run.tokens[2] == alone[2]
    assert run.speculated and all(rid == 2 for rid, _, _ in run.speculated)
    assert min(run.spec_steps) > run.last[1]  # none while both decoded
