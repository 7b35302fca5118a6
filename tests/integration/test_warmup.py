"""The actor's warm-up: what it visits before the server reports ready (`actor._actor.Actor._warmup`).

On CUDA, MLX compiles a kernel the first time an operation meets a dtype, for
seconds, so the GPU warm-up rehearses every path of the actor that live
traffic takes. These tests run the GPU's warm-up on the CPU (`_gpu = True`)
and check what it visited and that it leaves nothing behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trio_mlx.actor import (
    ActorConfig,
    ActorTuning,
    SamplingParams,
    Submit,
    _actor,
    _batch,
    _decode,
    _prompt_cache,
    _sampling,
    _spec_step,
)
from trio_mlx.actor._actor import Actor


def _loaded(path: Path, gpu: bool, retire_steps: int = 16, decode_step: str = "owned", **tuning: Any) -> Actor:
    config = ActorConfig(model_path=path, tuning=ActorTuning(prefill_batch=2, admit_window=0.02,
                                                             retire_steps=retire_steps, decode_step=decode_step,
                                                             **tuning))
    actor = Actor(config, link=None)  # type: ignore[arg-type]
    actor._load()
    actor._gpu = gpu
    return actor


def _greedy(actor: Actor, prompt: tuple[int, ...], n: int) -> list[int]:
    """Serve one greedy request through the actor's own steps; its tokens."""
    out: list[int] = []
    failed = actor._apply([Submit(7, prompt, n, SamplingParams(temperature=0.0), frozenset())])
    for _ in range(4 * n):
        report = actor._step(failed or [])
        assert not report.failed
        out += [t.token for t in report.tokens if t.rid == 7]
        if len(out) >= n:
            return out
        failed = actor._apply([])
    raise AssertionError(f"no end after {4 * n} steps: {out}")


@pytest.fixture
def visits(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    return _spies(monkeypatch)


def _spies(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Records every removal (rows kept, whether the padding was trimmed), sampler,
    processor list and logprobs call the actor makes; with the owned decode step, every
    plan of per-row parameters it builds and every batch of grammar masks."""
    seen: dict[str, list[Any]] = {"removals": [], "samplers": [], "processors": [], "logprobs": [], "masks": [],
                                  "stores": [], "hits": [], "plans": []}
    plan_init, masks = _decode._Plan.__init__, _decode.Decoder._masks

    def spy_plan(self: Any, rows: Any, width: int) -> None:
        plan_init(self, rows, width)
        seen["plans"].append(self)

    def spy_masks(self: Any, plan: Any, fed: Any) -> Any:
        out = masks(self, plan, fed)
        seen["masks"] += [(None, plan.rows[i].grammar.error) for i in plan.grammar]
        return out

    monkeypatch.setattr(_decode._Plan, "__init__", spy_plan)
    monkeypatch.setattr(_decode.Decoder, "_masks", spy_masks)
    remove, sampler, processors = _batch.remove_rows, _sampling.make_sampler, _actor.make_processors
    add_logprobs = _actor.add_logprobs

    def spy_remove(bg: Any, uids: list[int]) -> None:
        caches = _batch._kv_caches(bg._generation_batch)
        assert caches is not None
        idx = caches[0]._idx
        remove(bg, uids)
        kept = len(bg._generation_batch.uids)
        seen["removals"].append((kept, kept > 0 and caches[0]._idx < idx))

    def spy_sampler(sp: SamplingParams) -> Any:
        seen["samplers"].append(sp)
        return sampler(sp)

    def spy_processors(sp: SamplingParams, prompt_len: int, context: int) -> list[Any]:
        procs = processors(sp, prompt_len, context)
        seen["processors"].append(len(procs))
        return procs

    def spy_logprobs(out: Any, rows: Any) -> None:
        seen["logprobs"].append(len(rows))
        add_logprobs(out, rows)

    class SpyGrammar(_actor.GrammarProcessor):
        def __call__(self, tokens: Any, logits: Any) -> Any:
            out = super().__call__(tokens, logits)
            seen["masks"].append((logits.dtype, self.error))
            return out

    monkeypatch.setattr(_actor, "GrammarProcessor", SpyGrammar)

    store, fetch = _prompt_cache.PromptCache.store, _prompt_cache.PromptCache.fetch

    def spy_store(self: Any, tokens: Any, layers: Any, salt: str = "") -> bool:
        seen["stores"].append(store(self, tokens, layers, salt))
        return seen["stores"][-1]

    def spy_fetch(self: Any, prompt: Any, limit: Any = None, salt: str = "") -> Any:
        got = fetch(self, prompt, limit, salt)
        seen["hits"].append(got[1])
        return got

    monkeypatch.setattr(_prompt_cache.PromptCache, "store", spy_store)
    monkeypatch.setattr(_prompt_cache.PromptCache, "fetch", spy_fetch)
    monkeypatch.setattr(_actor, "remove_rows", spy_remove)
    monkeypatch.setattr(_sampling, "make_sampler", spy_sampler)
    monkeypatch.setattr(_actor, "make_processors", spy_processors)
    monkeypatch.setattr(_actor, "add_logprobs", spy_logprobs)
    return seen


@pytest.fixture(scope="module")
def warmed_without_cuda(tiny_model_fp32: Path) -> tuple[Actor, dict[str, list[Any]]]:
    """The GPU warm-up of the default tuning (owned decode step) where CUDA is not available,
    and what it visited, the spies taken off after it: the rehearsal's visits (two tests
    read them, and the actor's state after it; neither serves on it) are one warm-up's,
    ~2.2 CPU-s each on the 2-core box."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(_actor.mx.cuda, "is_available", lambda: False)
        seen = _spies(monkeypatch)
        actor = _loaded(tiny_model_fp32, gpu=True)
        actor._warmup()
    return actor, seen


@pytest.mark.parametrize("decode_step", ["owned", "mlx"])
def test_the_gpu_warm_up_rehearses_a_trimming_removal_every_sampler_and_an_abort(tiny_model_fp32, request,
                                                                                  decode_step):
    if decode_step == "owned":  # the default tuning's warm-up, as test_on_cuda_...[False] reads it too
        actor, visits = request.getfixturevalue("warmed_without_cuda")
    else:
        visits = request.getfixturevalue("visits")
        actor = _loaded(tiny_model_fp32, gpu=True, decode_step=decode_step)
        actor._warmup()
    kept = [(rows, trimmed) for rows, trimmed in visits["removals"] if rows]
    # the retired row leaves while two stay (the first removal that gathers the kept rows'
    # tokens: 3.3 s of kernel compile on an H100), trimming the padding they share...
    assert (2, True) in kept
    # ...and the aborted row leaves while others stay
    assert len(kept) >= 2
    if decode_step == "owned":  # every array op of the batched sampling, in some plan
        plans = visits["plans"]
        assert any(p.seeded and p.unseeded and p.greedy is not None for p in plans)  # every kind of row
        assert any(p.sort and p.use_min_p for p in plans)
        assert any(p.bias is not None and p.penalized for p in plans)
        assert any(p.logprobs and p.top for p in plans)
        assert not visits["samplers"] and not visits["processors"] and not visits["logprobs"]
    else:
        sampled = [sp for sp in visits["samplers"] if not sp.greedy]
        assert any(sp.seed is not None for sp in sampled)
        assert any(sp.top_p < 1 and sp.top_k and sp.min_p for sp in sampled)
        assert max(visits["processors"]) == 3  # logit bias, repetition penalty, presence/frequency
        assert visits["logprobs"]
    # a grammar-masked row, masking the model's logits without error
    assert len(visits["masks"]) >= 2 and all(error is None for _, error in visits["masks"])
    # the prompt cache's paths: a finished row copied out and stored, a row entering with it
    assert True in visits["stores"] and max(visits["hits"]) > 0
    assert not actor._reuse.cache.enabled  # and nothing of it stays


@pytest.mark.parametrize("retire_steps", ["16", "0"])  # rows retired by the actor, or ended by the generator
def test_the_rehearsal_leaves_the_actor_as_it_found_it(tiny_model_fp32, visits, retire_steps):
    warmed = _loaded(tiny_model_fp32, gpu=True, retire_steps=int(retire_steps))
    warmed._warmup()
    assert not (warmed.schedule.seqs or warmed.schedule.by_uid or warmed.schedule.retired or warmed._admission.pending)
    assert warmed.schedule.decoding == warmed.schedule.steps == 0
    assert warmed._admission.window == 0.02  # the rehearsal's own (0) is gone
    assert warmed._bg is not None and not warmed._bg._generation_batch.uids
    cold = _loaded(tiny_model_fp32, gpu=False)
    prompt = tuple(range(5, 25))
    assert _greedy(warmed, prompt, 12) == _greedy(cold, prompt, 12)


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_with_speculation_the_rehearsal_verifies_greedy_and_sampled_rows(tiny_model_fp32, visits, monkeypatch, mode):
    """A greedy row and a seeded row with every sampling option take speculative steps in
    the rehearsal, side by side and (the seeded one) alone: the verifier's kernels, and the
    batched verify's, are built before ready. However slow its steps (here plain steps take
    no time at all), the rehearsal is not judged by them, and serving starts with no width
    judged."""
    from trio_mlx.actor._decode import Decoder

    monkeypatch.setattr(Decoder, "plain_step", lambda self, width: 1e-9)

    verified: list[Any] = []
    real = Decoder.verify

    def spy(self: Any, logits: Any, row: Any, drafts: Any, masks: Any = None) -> Any:
        verified.append(row.sampling)
        return real(self, logits, row, drafts, masks)

    monkeypatch.setattr(Decoder, "verify", spy)
    rolled: list[int] = []  # the rows of each speculative step
    roll = _spec_step.rollback
    monkeypatch.setattr(_spec_step, "rollback", lambda caches, stale: rolled.append(len(stale)) or roll(caches, stale))
    options = {"speculative": "ngram"} if mode == "ngram" else {"draft_model": str(tiny_model_fp32)}
    actor = _loaded(tiny_model_fp32, gpu=True, **options)
    actor._warmup()
    assert any(sp.greedy for sp in verified)
    assert any(sp.seed is not None and sp.logprobs and sp.repetition_penalty != 1.0 for sp in verified)
    assert 1 in rolled and 2 in rolled, rolled  # a lone row's steps, and two rows' in one batch
    assert not actor.schedule.seqs and actor._bg is not None and not actor._bg._generation_batch.uids
    assert actor._drafter.judging and actor._drafter.widths.steps == 0


def test_the_cpu_warm_up_is_one_short_sequence(tiny_model_fp32, visits):
    actor = _loaded(tiny_model_fp32, gpu=False)
    actor._warmup()
    assert visits["removals"] == visits["samplers"] == visits["logprobs"] == visits["masks"] == []
    assert all(p.all_greedy and not p.logprobs for p in visits["plans"])


@pytest.mark.parametrize("cuda", [True, False])
def test_on_cuda_the_rehearsal_prefills_a_long_prompt_and_a_hit_on_it(tiny_model_fp32, request, monkeypatch, cuda):
    """CUDA compiles kernels for the first long prompt (0.8-1.1 s each for the first long
    turns of a chat on an H100): the rehearsal prefills one in full chunks beside a long
    context, stores it, and enters a prompt extending it."""
    if cuda:
        visits = request.getfixturevalue("visits")
        monkeypatch.setattr(_actor.mx.cuda, "is_available", lambda: cuda)
        actor = _loaded(tiny_model_fp32, gpu=True)
        actor._warmup()
    else:  # the same warm-up as test_the_gpu_warm_up_...[owned]'s, without CUDA
        actor, visits = request.getfixturevalue("warmed_without_cuda")
    long = min(actor._context - 80, 2 * actor.config.tuning.prefill_step + 64)  # 944 of the tiny model's 1024
    assert (max(visits["hits"]) >= long) == cuda
    assert not actor._reuse.cache.enabled and not actor.schedule.seqs
