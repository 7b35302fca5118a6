"""The actor's own decode step (`actor/_decode.py`, hooked into mlx-lm's batch by `actor/_batch.own_decode`).

The sampling is checked on synthetic logits over a small vocabulary, where every
row's exact distribution is known (`_reference`: mlx-lm's rules written out in
numpy); the whole step through the actor on a tiny fp32 model, where greedy
tokens must be mlx-lm's own single-sequence generation's.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from trio_mlx.actor import Abort, ActorConfig, ActorTuning, SamplingParams, Submit, _decode
from trio_mlx.actor._actor import Actor
from trio_mlx.actor._decode import Decoder, DecodeRow

LOGITS = np.array([2.0, 1.4, 1.1, 0.6, 0.0, -0.4, -1.0, -1.6], dtype=np.float32)  # 8 tokens, some negative
PROMPT = (0, 6, 3)  # tokens the repetition penalty sees from the start (a positive, a negative logit)


def _reference(logits: np.ndarray, sp: SamplingParams, prompt: tuple[int, ...], generated: list[int]) -> np.ndarray:
    """The next token's distribution under mlx-lm's rules: logit bias, repetition penalty
    (prompt and output), presence and frequency penalties (output), then on the
    log-softmax top-p, min-p, top-k (`mlx_lm.sample_utils`), then temperature."""
    x = logits.astype(np.float64).copy()
    for t, v in sp.logit_bias:
        x[t] += v
    if sp.repetition_penalty != 1.0:
        for t in set(prompt) | set(generated):
            x[t] = x[t] * sp.repetition_penalty if x[t] < 0 else x[t] / sp.repetition_penalty
    for t, c in collections.Counter(generated).items():
        x[t] -= sp.frequency_penalty * c + sp.presence_penalty
    if sp.greedy:
        p = np.zeros_like(x)
        p[int(np.argmax(x))] = 1.0
        return p
    lp = x - np.log(np.exp(x - x.max()).sum()) - x.max()
    keep = np.ones_like(lp, dtype=bool)
    if 0.0 < sp.top_p < 1.0:  # apply_top_p: drop tokens with at least top_p of the mass above them
        order = np.argsort(lp)
        probs = np.exp(lp[order])
        above = np.cumsum(probs[::-1])[::-1] - probs
        dropped = int((above >= sp.top_p * probs.sum()).sum())
        keep &= lp >= lp[order][dropped]
    if sp.min_p > 0.0:
        keep &= lp >= lp.max() + math.log(sp.min_p)
    if 0 < sp.top_k < len(lp):
        keep &= lp >= np.sort(lp)[::-1][sp.top_k - 1]
    y = np.where(keep, lp / sp.temperature, -np.inf)
    e = np.exp(y - y.max())
    return e / e.sum()


def _draw(rows: list[DecodeRow], logits: np.ndarray, steps: int) -> list[list[int]]:
    """`steps` tokens for every row, each step's logits `logits` (rows, vocab)."""
    decoder = Decoder()
    x = mx.array(logits)
    inputs = mx.array([PROMPT[-1]] * len(rows))
    out: list[list[int]] = [[] for _ in rows]
    for k in range(steps):
        sampled, _ = decoder.step(x, rows, inputs, k == 0)
        for i, t in enumerate(sampled.tolist()):
            out[i].append(t)
        inputs = sampled
    return out


def _chi2_limit(df: int, z: float = 3.29) -> float:
    """The chi-square statistic exceeded with probability ~5e-4 (Wilson-Hilferty)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.5, top_p=0.7),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.0, min_p=0.3),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=4, min_p=0.1),
    SamplingParams(temperature=1.0, repetition_penalty=1.6),
    SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.6),
    SamplingParams(temperature=1.0, logit_bias=((5, 2.5), (0, -1.0))),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
]


def test_every_row_samples_from_its_own_parameters_distribution_in_one_mixed_batch():
    """One batch holding rows of every sampling option side by side (and greedy rows): each
    option's tokens over three steps fit, by chi-square, the distribution mlx-lm's rules
    give each row from its own history; tokens those rules forbid never appear; seeded
    rows (a seed each) fit as well."""
    mx.random.seed(11)
    per_case = 300
    cases = CASES + [SamplingParams(temperature=0.9, top_k=5, seed=-1)]
    rows: list[DecodeRow] = []
    for i in range(per_case):
        for c in cases:
            sp = dataclasses.replace(c, seed=i) if c.seed is not None else c
            rows.append(DecodeRow(sp, PROMPT))
    steps = 3
    out = _draw(rows, np.tile(LOGITS, (len(rows), 1)), steps)
    for n, case in enumerate(cases):
        expected = np.zeros(len(LOGITS))
        observed = np.zeros(len(LOGITS))
        for i in range(n, len(rows), len(cases)):
            for k in range(steps):
                expected += _reference(LOGITS, rows[i].sampling, PROMPT, out[i][:k])
                observed[out[i][k]] += 1
        assert observed[expected < 1e-9].sum() == 0, (case, observed, expected)
        live = expected >= 1e-9
        if live.sum() == 1:  # greedy: every token the argmax of the processed logits
            assert observed[live].sum() == per_case * steps
            continue
        stat = float((((observed - expected) ** 2)[live] / expected[live]).sum())
        assert stat < _chi2_limit(int(live.sum()) - 1), (case, stat, observed, expected)


def test_a_seeded_row_draws_the_same_tokens_alone_and_in_any_batch():
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    logits = np.tile(LOGITS, (1, 1))
    alone = _draw([DecodeRow(mine, PROMPT)], logits, 24)[0]
    for others in (3, 9):
        rows = [DecodeRow(SamplingParams(temperature=1.0, seed=i if i % 2 else None), PROMPT) for i in range(others)]
        rows.insert(others // 2, DecodeRow(mine, PROMPT))
        rows.append(DecodeRow(SamplingParams(temperature=0.0), PROMPT))
        batched = _draw(rows, np.tile(LOGITS, (len(rows), 1)), 24)[others // 2]
        assert batched == alone
    other = _draw([DecodeRow(SamplingParams(temperature=1.0, top_p=0.95, seed=99), PROMPT)], logits, 24)[0]
    assert other != alone


def test_logprobs_are_the_log_softmax_of_the_processed_logits_for_the_rows_that_ask():
    """`DecodeRow.out` after a step: the log-softmax (after bias and penalties) at the token
    the row was fed, and the top ones, sorted; rows that do not ask get nothing."""
    mx.random.seed(3)
    asks = SamplingParams(temperature=1.0, logit_bias=((7, 3.0),), frequency_penalty=0.5, logprobs=True,
                          top_logprobs=3)
    rows = [DecodeRow(asks, PROMPT), DecodeRow(SamplingParams(temperature=1.0), PROMPT),
            DecodeRow(SamplingParams(temperature=0.0, logprobs=True), PROMPT)]
    decoder = Decoder()
    x = mx.array(np.tile(LOGITS, (3, 1)))
    inputs = mx.array([PROMPT[-1]] * 3)
    history: list[list[int]] = [[], [], []]
    for k in range(4):
        sampled, fed = decoder.step(x, rows, inputs, k == 0)
        if k:
            for i in (0, 2):
                lp, top = rows[i].out  # type: ignore[misc]
                x_ref = _processed(LOGITS, rows[i].sampling, history[i][:-1])
                ref = x_ref - np.log(np.exp(x_ref).sum())
                assert fed[i] == history[i][-1]
                assert lp == pytest.approx(ref[fed[i]], abs=1e-5)
                if rows[i].sampling.top_logprobs:
                    assert top is not None and [t for t, _ in top] == list(np.argsort(-ref)[:3])
                    assert [v for _, v in top] == pytest.approx(sorted(ref, reverse=True)[:3], abs=1e-5)
                else:
                    assert top is None
            assert rows[1].out is None
        for i, t in enumerate(sampled.tolist()):
            history[i].append(t)
        inputs = sampled


def _processed(logits: np.ndarray, sp: SamplingParams, generated: list[int]) -> np.ndarray:
    x = logits.astype(np.float64).copy()
    for t, v in sp.logit_bias:
        x[t] += v
    for t, c in collections.Counter(generated).items():
        x[t] -= sp.frequency_penalty * c + sp.presence_penalty
    return x


class _OnlyToken4:
    """The decode step's side of `GrammarProcessor`: a grammar that allows token 4 alone,
    and notes each mask it fills in `events`."""

    error = None

    def __init__(self, events: list[str], fail: BaseException | None = None) -> None:
        self.events = events
        self.fail = fail
        self.fed: list[int | None] = []

    def new_bitmask(self, n: int) -> np.ndarray:
        return np.zeros((n, 1), dtype=np.int32)

    def bind(self, row: np.ndarray) -> None:
        self.row = row

    def consumes(self, token: int | None) -> bool:
        return False  # `begin` takes the token: no batch consume

    def begin(self, token: int | None) -> bool:
        if self.fail is not None:
            raise self.fail
        self.events.append("mask")
        self.fed.append(token)
        self.row[0, 0] = 1 << 4  # only token 4
        return False


class _Clock:
    """`_decode`'s clock in tests of 'auto' (`monkeypatch.setattr(_decode, "time", clock)`): it moves
    only by what the fakes say their work took, so the timings those tests compare do not hang on
    how busy the machine running them is."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def take(self, seconds: float) -> None:
        self.now += seconds


class _Fed:
    """A step's `inputs`: last step's tokens, each read noted in `events` (taking `delay` s, on
    `clock` when given, else slept)."""

    def __init__(self, values: list[int], events: list[str], delay: float = 0.0, clock: _Clock | None = None):
        self.values, self.events, self.delay, self.clock = values, events, delay, clock

    def tolist(self) -> list[int]:
        if self.clock is not None:
            self.clock.take(self.delay)
        elif self.delay:
            import time

            time.sleep(self.delay)
        self.events.append("read")
        return self.values


def test_the_next_step_starts_before_this_steps_tokens_are_read(monkeypatch):
    """Pipelined as mlx_lm's generate_step: the sampled tokens are started (`async_eval`) before
    the fed ones are read back; with a grammar row, the forward is started first, then the
    fed tokens read (the matchers need them), then the sampling started."""
    events: list[str] = []
    real = mx.async_eval

    def spy(*arrays: Any) -> None:
        events.append("start")
        real(*arrays)

    monkeypatch.setattr(mx, "async_eval", spy)
    rows = [DecodeRow(SamplingParams(temperature=1.0), PROMPT), DecodeRow(SamplingParams(temperature=0.0), PROMPT)]
    decoder = Decoder()
    fed = _Fed([1, 2], events)
    sampled, got = decoder.step(mx.array(np.tile(LOGITS, (2, 1))), rows, fed, False)
    assert got == [1, 2] and events == ["start", "read"]

    g = _OnlyToken4(events)
    rows.append(DecodeRow(SamplingParams(temperature=1.0), PROMPT, g))  # type: ignore[arg-type]
    events.clear()
    sampled, _ = decoder.step(mx.array(np.tile(LOGITS, (3, 1))), rows, _Fed([1, 2, 3], events), False)
    assert events == ["start", "read", "mask", "start"] and g.fed == [3]
    assert sampled.tolist()[2] == 4


def _constrained_rows(events: list[str], fail: BaseException | None = None) -> tuple[list[DecodeRow], _OnlyToken4]:
    g = _OnlyToken4(events, fail)
    rows = [DecodeRow(SamplingParams(temperature=1.0), PROMPT), DecodeRow(SamplingParams(temperature=0.0), PROMPT),
            DecodeRow(SamplingParams(temperature=1.0), PROMPT, g)]  # type: ignore[arg-type]
    return rows, g


def test_grammar_masks_before_reads_the_tokens_first_and_fills_the_masks_beside_the_forward(monkeypatch):
    """`grammar_masks` 'before': last step's tokens are read before the forward is started,
    the masks are filled in the decoder's thread (before the sampling starts), and the row
    gets what its mask allows, as with 'after'. The first step, whose logits' width is not
    known yet, fills them after."""
    events: list[str] = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (events.append("start"), real(*a))[1])
    rows, g = _constrained_rows(events)
    decoder = Decoder(grammar_masks="before")
    logits = mx.array(np.tile(LOGITS, (3, 1)))
    assert decoder.masks_first(rows, _Fed([1, 2, 3], events), False) is None  # no width yet
    decoder.step(logits, rows, _Fed([1, 2, 3], events), False)
    assert events == ["start", "read", "mask", "start"]
    events.clear()
    early = decoder.masks_first(rows, _Fed([5, 6, 7], events), False)
    assert early is not None and events[0] == "read"
    sampled, fed = decoder.step(logits, rows, _Fed([0, 0, 0], events), False, early)
    assert fed == [5, 6, 7] and g.fed == [3, 7] and sampled.tolist()[2] == 4
    assert events.count("read") == 1 and events.index("mask") < len(events) - 1 and events[-1] == "start"
    assert decoder.early_steps == 1


def test_grammar_masks_auto_goes_before_only_while_the_tokens_were_ready_when_read(monkeypatch):
    """'auto': after a read that found last step's tokens ready, masks go before the forward;
    every `AUTO_RECHECK` such steps one reads after the forward again, and a read that waited
    (the device behind the host) keeps them after."""
    monkeypatch.setattr(_decode, "AUTO_RECHECK", 3)
    monkeypatch.setattr(_decode, "AUTO_WAIT", 0.05)
    monkeypatch.setattr(_decode, "AUTO_ROWS", 1)  # the one grammar row here is enough
    clock = _Clock()
    monkeypatch.setattr(_decode, "time", clock)
    events: list[str] = []
    rows, g = _constrained_rows(events)
    decoder = Decoder(grammar_masks="auto")
    logits = mx.array(np.tile(LOGITS, (3, 1)))
    decoder.step(logits, rows, _Fed([1, 2, 3], events, clock=clock), False)  # timed: ready at once
    kinds = []
    for _ in range(8):
        early = decoder.masks_first(rows, _Fed([1, 2, 3], events, clock=clock), False)
        kinds.append("before" if early else "after")
        decoder.step(logits, rows, _Fed([1, 2, 3], events, clock=clock), False, early)
    assert kinds == ["before", "before", "before", "after", "before", "before", "before", "after"]
    slow = Decoder(grammar_masks="auto")
    for _ in range(3):
        early = slow.masks_first(rows, _Fed([1, 2, 3], events, delay=0.1, clock=clock), False)
        assert early is None
        slow.step(logits, rows, _Fed([1, 2, 3], events, delay=0.1, clock=clock), False, early)
    assert slow.early_steps == 0 and decoder.early_steps == 6


def test_grammar_masks_auto_keeps_the_masks_of_few_grammar_rows_after_the_forward(monkeypatch):
    """'auto': a batch with fewer than `AUTO_ROWS` grammar rows fills its masks after the
    forward, however ready the tokens were; with as many, before it."""
    monkeypatch.setattr(_decode, "AUTO_WAIT", 0.5)  # every read here counts as ready
    monkeypatch.setattr(_decode, "AUTO_ROWS", 2)
    events: list[str] = []
    rows, g = _constrained_rows(events)
    decoder = Decoder(grammar_masks="auto")
    logits = mx.array(np.tile(LOGITS, (3, 1)))

    def kinds(rows: list[DecodeRow], n: int) -> list[str]:
        out = []
        for _ in range(n):
            early = decoder.masks_first(rows, _Fed([1, 2, 3], events), False)
            out.append("before" if early else "after")
            decoder.step(logits, rows, _Fed([1, 2, 3], events), False, early)
        return out

    decoder.step(logits, rows, _Fed([1, 2, 3], events), False)
    assert kinds(rows, 4) == ["after"] * 4 and decoder.early_steps == 0
    two = [rows[0], DecodeRow(SamplingParams(temperature=1.0), PROMPT, _OnlyToken4(events)), rows[2]]  # type: ignore[arg-type]
    decoder.step(logits, two, _Fed([1, 2, 3], events), False)
    assert kinds(two, 3) == ["before"] * 3 and decoder.early_steps == 3


def test_an_owned_step_fills_masks_early_only_once_its_forward_is_built():
    """`_owned_step` builds the forward's graph before `masks_first` reads last step's tokens:
    the fill then overlaps MLX's encoding of the forward (in `step`), not its Python build."""
    from types import SimpleNamespace

    from trio_mlx.actor import _batch

    events: list[str] = []

    class _Decoder:
        def masks_first(self, rows: object, inputs: object, first: bool) -> None:
            events.append("masks_first")

        def step(self, logits: object, rows: object, inputs: object, first: bool, early: object) -> tuple:
            events.append("step")
            return mx.array([4]), [7]

    def model(inputs: mx.array, cache: object = None) -> mx.array:
        events.append("forward")
        return mx.zeros((1, 1, 8))

    batch = SimpleNamespace(_next_tokens=mx.array([7]), _next_logprobs=[None], prompt_cache=[], model=model,
                            uids=[1], samplers=[], tokens=[[]])
    fed, _ = _batch._owned_step(_Decoder(), batch, False)  # type: ignore[arg-type]
    assert events == ["forward", "masks_first", "step"]
    assert fed == [7] and batch.tokens == [[7]]


def test_grammar_masks_auto_turns_before_down_while_its_read_waits_longer_than_the_masks(monkeypatch):
    """'auto': once `AUTO_READS` reads made before the forward waited longer than the masks take
    after it, the steps go 'after' (one goes 'before' every `AUTO_RECHECK` to time the read
    again); masks that grow slower than that read bring 'before' back."""
    monkeypatch.setattr(_decode, "AUTO_READS", 2)
    monkeypatch.setattr(_decode, "AUTO_RECHECK", 3)
    monkeypatch.setattr(_decode, "AUTO_WAIT", 0.5)  # every read here counts as ready
    monkeypatch.setattr(_decode, "AUTO_ROWS", 1)
    clock = _Clock()
    monkeypatch.setattr(_decode, "time", clock)
    events: list[str] = []
    rows, g = _constrained_rows(events)
    slow = {"mask": 0.0}
    begin = g.begin

    def timed_begin(token: int | None) -> bool:
        clock.take(slow["mask"])
        return begin(token)

    g.begin = timed_begin  # type: ignore[method-assign]
    decoder = Decoder(grammar_masks="auto")
    logits = mx.array(np.tile(LOGITS, (3, 1)))

    def kinds(n: int) -> list[str]:
        out = []
        for _ in range(n):
            early = decoder.masks_first(rows, _Fed([1, 2, 3], events, delay=0.02, clock=clock), False)
            out.append("before" if early else "after")
            decoder.step(logits, rows, _Fed([1, 2, 3], events, delay=0.02, clock=clock), False, early)
        return out

    decoder.step(logits, rows, _Fed([1, 2, 3], events, clock=clock), False)  # the first read after, timed
    assert kinds(10) == ["before", "before", "after", "after", "after", "before", "after", "after", "after",
                         "before"]
    slow["mask"] = 0.1  # masks slower than the read: once one is timed (the median of two), 'before'
    assert kinds(4) == ["after", "before", "before", "before"]


def test_a_mask_fill_that_raises_beside_the_forward_raises_from_the_step():
    """What the fill raised in the decoder's thread is raised by `step`, as a fill after the
    forward raises it (the actor then fails the step's rows)."""
    events: list[str] = []
    rows, g = _constrained_rows(events)
    decoder = Decoder(grammar_masks="before")
    logits = mx.array(np.tile(LOGITS, (3, 1)))
    decoder.step(logits, rows, _Fed([1, 2, 3], events), False)
    g.fail = ValueError("the matcher broke")
    early = decoder.masks_first(rows, _Fed([1, 2, 3], events), False)
    assert early is not None
    with pytest.raises(ValueError, match="the matcher broke"):
        decoder.step(logits, rows, _Fed([1, 2, 3], events), False, early)


# -- the step through the actor, on a tiny model ----------------------------------------


class _Link:
    def built(self) -> None:  # the step's graph is built: nobody waits for it here
        pass


def _actor(path: Path, **config: Any) -> Actor:
    # No waiting for company unless a test asks (the actor's own default was 0 when these were written).
    tuning = ActorTuning(**{"warmup": False, "admit_window": 0.0, **config})
    actor = Actor(ActorConfig(model_path=path, tuning=tuning), link=_Link())  # type: ignore[arg-type]
    actor._load()
    return actor


def _reference_greedy(path: Path, prompt: tuple[int, ...], n: int) -> list[int]:
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def _serve(actor: Actor, script: dict[int, list[Any]], steps: int) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Run the actor's own `_apply` and `_step` for `steps` steps, applying `script[k]` before
    step k: each rid's tokens, and the step each rid's last token came in."""
    tokens: dict[int, list[int]] = collections.defaultdict(list)
    last: dict[int, int] = {}
    for k in range(steps):
        failed = actor._apply(script.get(k, []))
        report = actor._step(failed or [])
        assert not report.failed, report.failed
        for t in report.tokens:
            tokens[t.rid].append(t.token)
            last[t.rid] = k
    return tokens, last


def test_a_step_with_no_rows_left_reports_the_prompt_cache_beside_its_memory(tiny_model_fp32):
    """A batch that runs dry stores its rows in the prompt cache as it settles. Where the settled
    report is not sent (a command came: `_next_commands`), the step that follows, with no rows,
    reads MLX's memory again; without the cache's figures beside it, the engine counted the
    stored rows in MLX's memory and not in the cache until the cache next changed (the soak's
    idle memory 1.1 MB over its warm-up level)."""
    actor = _actor(tiny_model_fp32, retire_steps=1000)
    actor._open_cache()  # as once warm
    figures = None
    for k in range(8):
        sub = [Submit(1, tuple(range(5, 205)), 3, SamplingParams(temperature=0.0), frozenset())] if k == 0 else []
        report = actor._step(actor._apply(sub) or [])
        if report.prompt_cache is not None:
            figures = report.prompt_cache
    assert actor._reuse.cache.stats()[5] == 1  # the row's prompt and answer, stored as the batch ran dry
    assert figures == actor._reuse.cache.stats()


def test_greedy_tokens_are_mlx_lm_generates_in_a_batch_of_16_with_rows_entering_and_leaving(tiny_model_fp32):
    """16 prompts of 2-40 tokens enter in four groups while others decode, finish at
    different lengths and retire; one is aborted mid-stream and makes no token after the
    step it was aborted before. Every other row's tokens are mlx_lm's own greedy ones."""
    rng = random.Random(5)
    actor = _actor(tiny_model_fp32, max_batch=16, prefill_batch=4, admit_window=0.0, retire_steps=3)
    vocab = actor._vocab
    prompts = {rid: tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(2, 40))) for rid in range(16)}
    lengths = {rid: rng.randrange(6, 20) for rid in range(16)}
    script: dict[int, list[Any]] = {}
    for group, at in enumerate((0, 3, 7, 12)):
        script[at] = [Submit(rid, prompts[rid], lengths[rid], SamplingParams(temperature=0.0), frozenset())
                      for rid in range(4 * group, 4 * group + 4)]
    script.setdefault(9, []).append(Abort(5))
    tokens, last = _serve(actor, script, 60)
    assert last[5] < 9 and len(tokens[5]) < lengths[5]
    assert 5 not in {s.rid for s in actor.schedule.seqs.values()}
    for rid in range(16):
        if rid != 5:
            assert tokens[rid] == _reference_greedy(tiny_model_fp32, prompts[rid], lengths[rid]), rid
    assert not actor.schedule.seqs and not actor._bg._generation_batch.uids  # type: ignore[union-attr]


def test_a_group_whose_prompts_end_joins_the_decoding_rows_step(tiny_model_fp32, monkeypatch):
    """Rows whose prompts have only their last token left join the decoding batch before its
    step, which feeds them that token beside the others' (`_batch._join`): one one-token
    forward in that step, where mlx_lm's `_next` takes two (the decoding rows' step, then the
    group's own first step). Their first tokens come in the same step as before, the greedy
    rows' tokens are mlx_lm's own, and a JSON-constrained row that joins (its grammar fed
    nothing at its first step) still writes JSON."""
    import json

    from trio_mlx import models
    from trio_mlx.actor import Grammar
    from trio_mlx.actor._batch import CausalPrefill
    from trio_mlx.actor._constrain import json_string_grammar, model_vocab

    one_token: list[int] = []
    real = CausalPrefill.__call__

    def counted(self: Any, inputs: Any, cache: Any = None, **kwargs: Any) -> Any:
        if inputs.shape[1] == 1:
            one_token.append(inputs.shape[0])
        return real(self, inputs, cache, **kwargs)

    monkeypatch.setattr(CausalPrefill, "__call__", counted)
    actor = _actor(tiny_model_fp32, max_batch=8, prefill_batch=4)
    stops = frozenset(model_vocab(tiny_model_fp32).eos)
    grammar = Grammar(source=json_string_grammar(), min_tokens=2, kind="json_schema")
    first = [Submit(rid, (5 + rid, 6, 7, 8), 20, SamplingParams(temperature=0.0), frozenset()) for rid in range(2)]
    group = [Submit(2, (9, 10, 11, 12, 13), 12, SamplingParams(temperature=0.0), frozenset()),
             Submit(3, (14, 15, 16), 12, SamplingParams(temperature=1.0, seed=3), stops, grammar)]
    steps: list[list[int]] = []  # the widths of each step's one-token forwards
    tokens: dict[int, list[int]] = collections.defaultdict(list)
    came: dict[int, int] = {}
    for k in range(30):
        failed = actor._apply(first if k == 0 else group if k == 4 else [])
        one_token.clear()
        report = actor._step(failed or [])
        assert not report.failed, report.failed
        steps.append(list(one_token))
        for t in report.tokens:
            came.setdefault(t.rid, k)
            tokens[t.rid].append(t.token)
    # step 4 prefills the group beside the decoding rows; step 5 feeds its last prompt
    # tokens in the decoding rows' own forward, four rows wide
    assert steps[4] == [2] and steps[5] == [4], steps[3:7]
    # read at once beside so few rows (`EARLY_FIRST_BESIDE`); a constrained row's, a step later
    assert came[2] == 5 and came[3] == 6
    for rid, sub in ((0, first[0]), (1, first[1]), (2, group[0])):
        assert tokens[rid] == _reference_greedy(tiny_model_fp32, sub.prompt, sub.max_tokens), rid
    text = models.load_tokenizer(tiny_model_fp32).decode([t for t in tokens[3] if t not in stops])
    assert isinstance(json.loads(text), str), text


def test_the_owned_step_and_mlx_lms_give_the_same_greedy_tokens_with_bias_and_penalties(tiny_model_fp32):
    """TRIO_MLX_DECODE_STEP switches between the two steps; greedy rows with logit bias and
    every penalty, beside plain ones, make the same tokens under either."""
    sps = [SamplingParams(temperature=0.0),
           SamplingParams(temperature=0.0, logit_bias=((40, 4.0), (41, 2.0))),
           SamplingParams(temperature=0.0, repetition_penalty=1.3),
           SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.8),
           SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5, logprobs=True,
                          top_logprobs=2)]
    prompts = [tuple(range(10 + i, 30 + 3 * i)) for i in range(len(sps))]

    def serve(step: str) -> tuple[dict[int, list[int]], list[Any]]:
        actor = _actor(tiny_model_fp32, max_batch=8, prefill_batch=8, decode_step=step)
        subs = [Submit(i, p, 16, sp, frozenset()) for i, (p, sp) in enumerate(zip(prompts, sps, strict=True))]
        logprobs: list[Any] = []
        tokens: dict[int, list[int]] = collections.defaultdict(list)
        failed = actor._apply(subs)
        for _ in range(40):
            report = actor._step(failed or [])
            for t in report.tokens:
                tokens[t.rid].append(t.token)
                if t.rid == 4:
                    logprobs.append((t.logprob, t.top_logprobs))
            failed = actor._apply([])
        return tokens, logprobs

    owned, owned_lp = serve("owned")
    mlx, mlx_lp = serve("mlx")
    assert owned == mlx and all(len(v) == 16 for v in owned.values())
    assert owned[1].count(40) > owned[0].count(40)  # the bias steered
    for (a, top_a), (b, top_b) in zip(owned_lp, mlx_lp, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
        assert [t for t, _ in top_a] == [t for t, _ in top_b]


def test_constrained_rows_fill_their_masks_together_beside_free_rows(tiny_model_fp32, monkeypatch):
    """Three JSON-constrained rows (sampled) and three free ones in one batch: every constrained
    output parses, and their masks were filled by llguidance's batch fill."""
    import json

    from trio_mlx.actor import Grammar
    from trio_mlx.actor._constrain import json_string_grammar

    batches: list[int] = []
    real = _decode.Decoder._fill_many

    def spy(self: Any, fill: Any, bitmask: Any) -> None:
        batches.append(len(fill))
        real(self, fill, bitmask)

    monkeypatch.setattr(_decode.Decoder, "_fill_many", spy)
    actor = _actor(tiny_model_fp32, max_batch=8, prefill_batch=8)
    grammar = Grammar(source=json_string_grammar(), min_tokens=2, kind="json_schema")
    from trio_mlx.actor._constrain import model_vocab

    stops = frozenset(model_vocab(tiny_model_fp32).eos)
    subs = [Submit(i, (5 + i, 6, 7), 24, SamplingParams(temperature=1.0, seed=i), stops, grammar if i < 3 else None)
            for i in range(6)]
    tokens, _ = _serve(actor, {0: subs}, 40)
    from trio_mlx import models

    tok = models.load_tokenizer(tiny_model_fp32)
    for i in range(3):
        text = tok.decode([t for t in tokens[i] if t not in stops])
        assert isinstance(json.loads(text), str), text
    assert batches and max(batches) >= 2


@pytest.mark.parametrize("when", ["before", "auto"])
def test_masks_filled_beside_the_forward_give_the_tokens_of_masks_filled_after_it(tiny_model_fp32, when,
                                                                                   monkeypatch):
    """JSON-constrained rows (seeded sampling, one greedy) beside free rows, some entering
    while others decode: every row's tokens are the same whether the masks are filled after
    the forward or beside it, and beside it is what the steps did ('auto' switching between
    the two: every read counts as ready here, and as waiting less than the masks take, the
    CPU's being as slow as the box is busy: on a loaded CI machine the reads made first once
    outlasted the masks, and 'auto' rightly went back to 'after' for a few steps)."""
    monkeypatch.setattr(_decode, "AUTO_WAIT", 60.0)
    monkeypatch.setattr(_decode.Decoder, "_waits_past_masks", lambda self: False)
    monkeypatch.setattr(_decode, "AUTO_ROWS", 1)  # the batch holds at most 4 grammar rows
    from trio_mlx.actor import Grammar
    from trio_mlx.actor._constrain import json_string_grammar, model_vocab

    grammar = Grammar(source=json_string_grammar(), min_tokens=2, kind="json_schema")
    stops = frozenset(model_vocab(tiny_model_fp32).eos)

    def run(masks: str) -> tuple[dict[int, list[int]], int]:
        actor = _actor(tiny_model_fp32, max_batch=8, prefill_batch=4, grammar_masks=masks)
        subs = [Submit(i, (5 + i, 6, 7), 20, SamplingParams(temperature=0.0 if i == 0 else 1.0, seed=i), stops,
                       grammar if i % 2 == 0 else None) for i in range(8)]
        tokens, _ = _serve(actor, {0: subs[:4], 5: subs[4:]}, 40)
        return dict(tokens), actor._decoder.early_steps  # type: ignore[union-attr]

    after, none_early = run("after")
    beside, early = run(when)
    assert beside == after and none_early == 0 and early > 10


def test_one_masked_query_is_what_the_cuda_kernel_is_given():
    """`_cuda_attention.applies`: the one-query attention a decode step of left-padded rows
    makes (B, H, 1, D) under a mask of (1 or B, 1 or H, 1, T), boolean or additive, GQA or
    not; not several queries, a head size the kernel's lanes do not divide, a mask of
    another shape, or none."""
    from trio_mlx.actor._cuda_attention import applies

    q, k = mx.zeros((3, 4, 1, 64)), mx.zeros((3, 2, 9, 64))
    keep = mx.ones((3, 1, 1, 9), dtype=mx.bool_)
    assert applies(q, k, k, keep)
    assert applies(q, k, k, mx.zeros((1, 4, 1, 9)))  # additive, per head, broadcast over rows
    assert applies(q.astype(mx.bfloat16), k.astype(mx.bfloat16), k.astype(mx.bfloat16), keep)
    assert not applies(q, k, k, None)
    assert not applies(mx.zeros((3, 4, 2, 64)), k, k, mx.ones((3, 1, 2, 9), dtype=mx.bool_))  # two queries
    assert not applies(mx.zeros((3, 4, 1, 80)), mx.zeros((3, 2, 9, 80)), mx.zeros((3, 2, 9, 80)), keep)
    assert not applies(q, k, k, mx.ones((3, 1, 1, 8), dtype=mx.bool_))  # not one mask value per key
    assert not applies(q, k, k, mx.ones((2, 1, 1, 9), dtype=mx.bool_))  # rows the batch has not
    assert not applies(q, k.astype(mx.float16), k.astype(mx.float16), keep)  # keys of another type
    assert not applies(q, mx.zeros((3, 3, 9, 64)), mx.zeros((3, 3, 9, 64)), keep)  # 4 heads over 3


def test_a_kernel_block_takes_the_query_heads_of_one_key_head_that_fit_its_registers():
    """`_cuda_attention._heads_per_block`: a divisor of the query heads per key head (the
    block reads one key head), with at most 16 floats of queries a lane (D / 32 each)."""
    from trio_mlx.actor._cuda_attention import _heads_per_block

    got = {(g, d): _heads_per_block(g, d) for g in (1, 3, 4, 6, 7, 8, 16) for d in (64, 96, 128, 256)}
    assert got[4, 64] == got[4, 128] == 4 and got[8, 64] == 8 and got[16, 64] == 8 and got[8, 128] == 4
    assert got[6, 128] == 3 and got[7, 128] == 1 and got[8, 256] == 2 and got[1, 64] == 1
    assert all(g % n == 0 and n * (d // 32) <= 16 for (g, d), n in got.items())


@pytest.fixture(scope="module")
def model_hd64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trio_mlx.models import _test_models

    return _test_models.build_test_model(tmp_path_factory.mktemp("tiny-hd64") / "model", shape="tiny-hd64")


@pytest.mark.parametrize("kernel", [False, True])
def test_left_padded_decode_steps_on_cuda_give_each_layers_attention_to_the_kernel(model_hd64, monkeypatch, kernel):
    """The actor's decode step as it runs on CUDA (its grid on, forced here), its rows of
    different lengths (left-padded, so each step's attention has an array mask): where the
    kernel runs, every layer's one-query attention is handed to `_cuda_attention.attention`
    with the padding's mask (standing in for the kernel here: the scores as matmuls, what
    MLX's own attention computes), and every row's greedy tokens are mlx-lm's own; where it
    does not, nothing is. A row decoding alone is unpadded: its steps have no mask, and
    MLX's fused attention takes them."""
    from trio_mlx.actor import _batch, _cuda_attention, _shapes

    real = _batch.few_queries
    monkeypatch.setattr(_batch, "few_queries", lambda on=True: real(True))
    monkeypatch.setattr(_cuda_attention, "available", lambda: kernel)
    given: list[tuple[tuple[int, ...], Any]] = []

    def reference(q: Any, k: Any, v: Any, scale: float, mask: Any) -> Any:
        given.append((tuple(q.shape), mask))
        return _shapes.attention(q, k, v, scale, mask)

    monkeypatch.setattr(_cuda_attention, "attention", reference)
    rng = random.Random(11)
    actor = _actor(model_hd64, max_batch=4, prefill_batch=4)
    prompts = {rid: tuple(rng.randrange(3, actor._vocab) for _ in range(n)) for rid, n in ((1, 5), (2, 17), (3, 30))}
    script = {0: [Submit(rid, p, 12, SamplingParams(temperature=0.0), frozenset()) for rid, p in prompts.items()]}
    tokens, _ = _serve(actor, script, 16)
    for rid, prompt in prompts.items():
        assert tokens[rid] == _reference_greedy(model_hd64, prompt, 12), rid
    layers = len(actor._model.layers)
    if not kernel:
        assert not given
        return
    assert len(given) >= 8 * layers  # every step of the three rows, in each layer
    assert all(shape == (3, 2, 1, 64) and mask.dtype == mx.bool_ and mask.shape[:3] == (3, 1, 1)
               for shape, mask in given)
    given.clear()
    alone = tuple(rng.randrange(3, actor._vocab) for _ in range(9))
    tokens, _ = _serve(actor, {0: [Submit(9, alone, 6, SamplingParams(temperature=0.0), frozenset())]}, 8)
    assert tokens[9] == _reference_greedy(model_hd64, alone, 6)
    assert not given


def test_warm_up_runs_the_padded_decode_steps_kernels_whole_and_split(model_hd64, monkeypatch):
    """`_warmup.prebuild_masked_decode` (CUDA's warm-up, forced here): decode steps of
    left-padded rows whose attention goes to `_cuda_attention.attention` behind a context
    short enough for one block over all the keys and one long enough to split them, so
    that NVRTC compiles both before the server reports ready."""
    from trio_mlx.actor import _batch, _cuda_attention, _shapes, _warmup
    from trio_mlx.models import load_model

    monkeypatch.setattr(_cuda_attention, "available", lambda: True)
    keys: list[int] = []

    def record(q: Any, k: Any, v: Any, scale: float, mask: Any) -> Any:
        keys.append(k.shape[2])
        return _shapes.attention(q, k, v, scale, mask)

    monkeypatch.setattr(_cuda_attention, "attention", record)
    model, config = load_model(model_hd64)
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config["hidden_size"] // heads
    _warmup.prebuild_masked_decode(_batch.CausalPrefill(model, grid=True), len(model.layers), 1)
    assert len(keys) == 2 * len(model.layers)
    assert {_cuda_attention.key_splits(2, heads, kv, d, t) > 1 for t in keys} == {False, True}


def test_warm_up_runs_matmuls_of_every_row_count_up_to_the_most_a_step_takes(tiny_model_fp32):
    """`_warmup.prebuild_matmuls` (CUDA's warm-up, for every model): one-row forwards of
    `MATMUL_ROWS` tokens from empty caches, up to the first that reaches the most rows a step
    multiplies and within the context, each with every position's logits (the output head
    over that many rows, which no prefill evaluates: a live step met it first, and MLX
    compiled its kernel then). `prebuild_cuda` takes the most from the tuning and the
    drafter, off the shape grid too (a model with `--kv-bits` is not on it)."""
    from trio_mlx.actor import _warmup
    from trio_mlx.actor._drafting import Drafter
    from trio_mlx.actor._tuning import ActorTuning
    from trio_mlx.models import load_model

    model, config = load_model(tiny_model_fp32)
    shapes: list[tuple[int, ...]] = []

    def forward(inputs: Any, cache: Any) -> Any:
        assert all(c.offset == 0 for c in cache)  # each from an empty cache of its own
        out = model(inputs, cache=cache)
        shapes.append(tuple(out.shape))
        return out

    forward.layers = model.layers  # type: ignore[attr-defined]  # what make_prompt_cache reads
    assert _warmup.prebuild_matmuls(forward, 1, 40, 4096) == [2, 9, 17, 33, 65]
    assert shapes == [(1, n, config["vocab_size"]) for n in (2, 9, 17, 33, 65)]
    assert _warmup.prebuild_matmuls(forward, 1, 8 * 33, 4096) == list(_warmup.MATMUL_ROWS)
    assert _warmup.prebuild_matmuls(forward, 1, 64, 40) == [2, 9, 17, 33]
    assert _warmup.prebuild_matmuls(forward, 1, 1, 4096) == [2]
    # Every class of MLX 0.32.4's quantized matmul on CUDA that a step of up to `most` rows
    # may meet is met (a 4-bit model's 15-row speculative step compiled the 16-row tile live)
    for most in (1, 7, 8, 12, 16, 17, 20, 32, 33, 64, 65, 300):
        assert ({_qmm_class(n) for n in _warmup.prebuild_matmuls(forward, 1, most, 4096)}
                >= {_qmm_class(n) for n in range(1, most + 1)}), most
    shapes.clear()
    assert _warmup.prebuild_cuda(forward, 1, 4096, ActorTuning(max_batch=8), Drafter(k=4, max_rows=4), False) == 0
    assert [s[1] for s in shapes] == [2, 9, 17, 33]  # 4 rows of 4 drafts and a token: 20
    shapes.clear()
    _warmup.prebuild_cuda(forward, 1, 4096, ActorTuning(max_batch=40), None, False)
    assert [s[1] for s in shapes] == [2, 9, 17, 33, 65]


def _qmm_class(rows: int) -> str:
    """The kernel MLX 0.32.4's CUDA quantized matmul takes for `rows` rows (its
    `QuantizedMatmul::eval_gpu`): the matrix-vector one below 8 rows, else a tiled one
    compiled per tile height, the next power of two within 16-64."""
    return "qmv" if rows < 8 else f"m{max(16, min(64, 1 << (rows - 1).bit_length()))}"
