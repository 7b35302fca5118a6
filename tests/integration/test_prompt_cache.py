"""The prompt cache (actor/_prompt_cache.py): greedy tokens with a hit are a cold run's, in every
stage mix, on the fp32 tiny model on the CPU; aborts and failures leave nothing half-written;
the counts reach Usage, statistics, the OpenAI usage and /metrics."""

from __future__ import annotations

import json
import threading

import pytest
import trio
from app_server import CHAT, COMPLETIONS, serve

import trio_mlx
from integration.test_engine import collect, run, settled, until

GREEDY = dict(temperature=0, ignore_eos=True)


def ids(n: int, start: int = 0) -> list[int]:
    """`n` prompt ids from the tiny model's ordinary tokens (past its specials)."""
    return [5 + (start + 7 * i) % 400 for i in range(n)]


# A cache-off engine's greedy tokens: the cold runs every hit is compared with. They are
# deterministic (one request at a time, greedy, nothing cached), so each (model, prompt, n) is run
# once a module run and its tokens handed to every test that compares with it: the last turn of
# ids(300) and its follow-up recur across five tests, and a job whose tokens are all known opens
# no engine. A test that patches how the model runs (the shape grid) runs its own: shared=False.
_COLD: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


async def cold_runs(model, jobs: list[tuple[list[int], int]], shared: bool = True) -> list[list[int]]:
    keys = [(str(model), tuple(prompt), n) for prompt, n in jobs]
    known = _COLD if shared else {}
    if any(key not in known for key in keys):
        async with trio_mlx.open_engine(model, max_batch=16, prompt_cache_gb=0) as engine:
            for key in keys:
                if key not in known:
                    got, _, fin = await run(engine, list(key[1]), max_tokens=key[2], **GREEDY)
                    assert fin.usage.cached_tokens == 0 and engine.statistics().prompt_cache_lookups == 0
                    known[key] = got
    return [list(known[key]) for key in keys]


@pytest.mark.parametrize("retire_steps", [16, 0])
async def test_a_follow_up_turn_reuses_the_last_turn_and_its_answer(tiny_model_fp32, retire_steps):
    """Stored as the finished row leaves the batch (retired rows), or, with retire_steps 0,
    from the cache the generator extracts itself when it ends the row."""
    system = ids(300)
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=8, retire_steps=retire_steps) as engine:
        first, _, f1 = await run(engine, system, max_tokens=12, **GREEDY)
        turn2 = system + first + ids(9, 3)
        second, _, f2 = await run(engine, turn2, max_tokens=12, **GREEDY)
        again, _, f3 = await run(engine, turn2, max_tokens=12, **GREEDY)
        s = engine.statistics()
    assert f1.usage.cached_tokens == 0
    assert f2.usage.cached_tokens == len(system) + len(first)  # the whole last turn, answer included
    assert f3.usage.cached_tokens == len(turn2) - 1  # the last prompt token always runs for its logits
    assert (s.prompt_cache_lookups, s.prompt_cache_hits) == (3, 2)
    assert s.prompt_cache_hit_tokens == f2.usage.cached_tokens + f3.usage.cached_tokens
    # what was prefilled (a prompt's last token enters with its first decode step, uncounted):
    # the first prompt, then only the new user turn, then nothing
    assert s.prompt_tokens == (len(system) - 1) + (9 - 1) + 0
    assert s.prompt_cache_bytes > 0 and s.prompt_cache_entries >= 1
    assert [first, second, again] == await cold_runs(tiny_model_fp32, [(system, 12), (turn2, 12), (turn2, 12)])


async def test_hits_and_misses_prefilled_together_and_a_hit_joining_a_decoding_batch(tiny_model_fp32):
    shared = ids(200, 1)
    prompts = [shared + ids(5 + i, 50 * i) for i in range(6)]
    jobs = [(shared, 6)] + [(p, 10) for p in prompts] + [(ids(40, 9), 30)] + [(prompts[2] + ids(4), 8)]
    expected = await cold_runs(tiny_model_fp32, jobs)
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=16, prefill_batch=8) as engine:
        warm, _, _ = await run(engine, shared, max_tokens=6, **GREEDY)
        got: dict[int, tuple[list[int], int]] = {}

        async def one(i: int, prompt: list[int], n: int) -> None:
            out, _, fin = await run(engine, prompt, max_tokens=n, **GREEDY)
            got[i] = (out, fin.usage.cached_tokens)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 7, *jobs[7])  # a long decode the others join: a miss
            await until(lambda: engine.statistics().decoding == 1)
            for i in range(1, 7):  # hits (on `shared`) and one miss, prefilled together
                nursery.start_soon(one, i, *jobs[i])
            await until(lambda: len(got) >= 6)
            nursery.start_soon(one, 8, *jobs[8])  # a hit entering while the others decode
    assert [warm] + [got[i][0] for i in range(1, 9)] == expected
    assert got[7][1] == 0 and all(got[i][1] >= len(shared) for i in range(1, 7))
    assert got[8][1] >= len(prompts[2])  # the conversation it continues (stored when it finished)


async def test_a_hit_whose_entry_is_evicted_meanwhile_keeps_its_tokens(tiny_model_fp32):
    """A bound that holds one entry (~550 bytes a token): every store evicts, while hits are in
    flight. (A prefill step of 32 keeps the hit's entry in use: misses among hits cached more
    than a step wait for the next group, `Reuse.even`.)"""
    convs = [ids(120, 40 * k) for k in range(4)]
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=16, prefill_step=32,
                                    prompt_cache_gb=100e3 / 1e9) as engine:
        for c in convs:
            await run(engine, c, max_tokens=4, **GREEDY)
        got: dict[int, tuple[list[int], int]] = {}

        async def one(k: int) -> None:
            out, _, fin = await run(engine, convs[k] + ids(6, k), max_tokens=8, **GREEDY)
            got[k] = (out, fin.usage.cached_tokens)

        async with trio.open_nursery() as nursery:
            for k in range(4):
                nursery.start_soon(one, k)
        await settled(engine)
        s = engine.statistics()
    assert s.prompt_cache_evictions >= 4 and s.prompt_cache_bytes <= 100e3
    assert any(n for _, n in got.values())  # the last stored conversation hit at least
    expected = await cold_runs(tiny_model_fp32, [(convs[k] + ids(6, k), 8) for k in range(4)])
    assert [got[k][0] for k in range(4)] == expected


@pytest.fixture
def prefill_masks(monkeypatch):
    """The mask of every prefill attention (more than one query) the llama model computes."""
    from mlx_lm.models import llama

    seen: list[str] = []
    sdpa = llama.scaled_dot_product_attention

    def spy(queries, *args, **kwargs):
        if queries.shape[2] > 1:
            mask = kwargs.get("mask")
            seen.append(mask if isinstance(mask, str) else type(mask).__name__)
        return sdpa(queries, *args, **kwargs)

    monkeypatch.setattr(llama, "scaled_dot_product_attention", spy)
    return seen


@pytest.mark.parametrize("step", [2048, 48])
async def test_hits_of_different_lengths_enter_evened_out_and_prefill_unpadded(tiny_model_fp32, prefill_masks,
                                                                                 step):
    """Two follow-ups cached to lengths 30 tokens apart and a fresh prompt arrive as one group.
    With the default step the longer hit is cut back to the shorter and the fresh prompt's
    zero evens them all out; with a step of 48 the two hits enter together (cut to the
    shorter) and the fresh prompt waits for the next group. Either way no prefill row is
    left-padded (every prefill attention gets mask="causal", the fused kernel on a GPU),
    and every row's tokens are a cold run's."""
    shared = ids(200, 1)
    a, b = shared + ids(60, 3), shared + ids(90, 5)
    fresh = ids(150, 11)
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=16, prefill_batch=8, prefill_step=step) as engine:
        answer_a, _, _ = await run(engine, a, max_tokens=6, **GREEDY)
        answer_b, _, _ = await run(engine, b, max_tokens=6, **GREEDY)
        jobs = [(a + answer_a + ids(20, 7), 8), (b + answer_b + ids(25, 9), 8), (fresh, 8), (ids(40, 9), 40)]
        got: dict[int, tuple[list[int], int]] = {}

        async def one(i: int) -> None:
            out, _, fin = await run(engine, jobs[i][0], max_tokens=jobs[i][1], **GREEDY)
            got[i] = (out, fin.usage.cached_tokens)

        prefill_masks.clear()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 3)  # a long decode the group joins (arrivals then wait for company)
            await until(lambda: engine.statistics().decoding == 1)
            for i in range(3):
                nursery.start_soon(one, i)
    shorter = len(a) + len(answer_a)
    if step == 2048:
        assert [got[i][1] for i in range(3)] == [0, 0, 0]
    else:
        assert [got[i][1] for i in range(3)] == [shorter, shorter, 0]
    assert prefill_masks and set(prefill_masks) == {"causal"}
    assert [got[i][0] for i in range(4)] == await cold_runs(tiny_model_fp32, jobs)


async def test_identical_prompts_together_prefill_once(tiny_model_fp32):
    """n > 1 (and users of one long prompt arriving together): the first prefills, the
    others wait for it and reuse its prompt's KV."""
    prompt = ids(150, 2)
    (expected,) = await cold_runs(tiny_model_fp32, [(prompt, 8)])
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=8, prefill_batch=8) as engine:
        streams = [engine.generate(prompt, max_tokens=8, **GREEDY) for _ in range(4)]
        results = []
        async with streams[0], streams[1], streams[2], streams[3]:
            for st in streams:
                results.append(await collect(st))
        s = engine.statistics()
    assert [r[0] for r in results] == [expected] * 4
    assert sorted(r[2].usage.cached_tokens for r in results) == [0] + [len(prompt) - 1] * 3
    assert s.prompt_tokens == len(prompt) - 1  # prefilled once (last tokens enter with decode steps)


async def test_seeded_sampling_and_penalties_with_a_hit_are_the_cold_run(tiny_model_fp32):
    """A hit enters with the cached prompt ids too (`all_tokens`), so the penalties that
    read the prompt (repetition) or skip it (presence, frequency) see what a cold run sees."""
    prompt = ids(200, 5)
    opts = dict(max_tokens=16, temperature=1.0, top_p=0.9, seed=77, ignore_eos=True,
                repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3)
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=8, prompt_cache_gb=0) as engine:
        cold, _, _ = await run(engine, prompt, **opts)
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=8) as engine:
        await run(engine, prompt + ids(3), max_tokens=2, **GREEDY)  # stores the prompt and more
        hit, _, fin = await run(engine, prompt, **opts)
    assert fin.usage.cached_tokens == len(prompt) - 1
    assert hit == cold


async def test_an_abort_mid_prefill_leaves_no_entry(tiny_model_fp32):
    long_prompt = ids(400, 8)
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=2, prefill_batch=1, prefill_step=4) as engine:
        stream = engine.generate(long_prompt, max_tokens=4, **GREEDY)
        async with stream:
            await until(lambda: stream.stage == "prefill")
        await until(lambda: engine.statistics().active == 0, seconds=5)
        assert engine.statistics().prompt_cache_entries == 0
        out, _, fin = await run(engine, long_prompt, max_tokens=6, **GREEDY)
    assert fin.usage.cached_tokens == 0
    assert [out] == await cold_runs(tiny_model_fp32, [(long_prompt, 6)])


async def test_an_abort_while_decoding_stores_its_prompt_but_not_its_answer(tiny_model_fp32):
    prompt = ids(300, 11)  # long: stored as soon as it is prefilled
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=4) as engine:
        stream = engine.generate(prompt, max_tokens=500, **GREEDY)
        produced: list[int] = []
        async with stream:
            async for ev in stream:
                produced.extend(getattr(ev, "token_ids", ()))
                if len(produced) >= 5:
                    break
        await until(lambda: engine.statistics().active == 0, seconds=5)
        out, _, fin = await run(engine, prompt + produced + ids(2), max_tokens=6, **GREEDY)
    assert fin.usage.cached_tokens == len(prompt)  # the prompt, none of the aborted answer
    assert [out] == await cold_runs(tiny_model_fp32, [(prompt + produced + ids(2), 6)])


async def test_a_failed_step_empties_the_cache_and_serving_goes_on(tiny_model_fp32):
    armed, fired = threading.Event(), threading.Event()

    def hook(stage: str) -> None:
        # once: tokens the reader takes after the failed step must not arm it again
        if stage == "step" and armed.is_set() and not fired.is_set():
            fired.set()
            raise RuntimeError("injected step fault")

    prompt = ids(300, 13)
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=4, fault_hook=hook) as engine:
        await run(engine, prompt, max_tokens=3, **GREEDY)
        assert engine.statistics().prompt_cache_entries == 1
        async with engine.generate(prompt + ids(3), max_tokens=400, **GREEDY) as stream:
            async for ev in stream:
                if isinstance(ev, trio_mlx.Finished):
                    assert ev.finish_reason == "error"
                elif not armed.is_set():
                    armed.set()  # fail the next step, while it decodes
        s = engine.statistics()
        assert s.step_failures == 1 and s.prompt_cache_entries == 0 and s.prompt_cache_bytes == 0
        out, _, fin = await run(engine, prompt, max_tokens=5, **GREEDY)
    assert fin.usage.cached_tokens == 0 and fin.finish_reason == "length"
    assert [out] == await cold_runs(tiny_model_fp32, [(prompt, 5)])


async def test_off_when_zero_and_through_the_process_actor(tiny_model_fp32):
    prompt = ids(260, 17)
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=4, prompt_cache_gb=0) as engine:
        for _ in range(2):
            _, _, fin = await run(engine, prompt, max_tokens=3, **GREEDY)
            assert fin.usage.cached_tokens == 0
        assert engine.statistics().prompt_cache_lookups == 0
        assert engine.info is not None and engine.info.prompt_cache_bytes == 0
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=4, actor="process", prompt_cache_gb=0.25) as engine:
        assert engine.info is not None and engine.info.prompt_cache_bytes == 250_000_000
        await run(engine, prompt, max_tokens=3, **GREEDY)
        _, _, fin = await run(engine, prompt, max_tokens=3, **GREEDY)
        await until(lambda: engine.statistics().prompt_cache_hits == 1)
        assert fin.usage.cached_tokens == len(prompt) - 1


async def test_openai_usage_and_metrics_report_cached_tokens(tiny_model_fp32):
    messages = [{"role": "system", "content": "You are terse. " * 60}, {"role": "user", "content": "hi"}]
    async with serve(tiny_model_fp32) as server, server.client() as client:
        body = {"messages": messages, "max_tokens": 4, "temperature": 0}
        first = (await client.post(CHAT, json=body)).json()["usage"]
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        second = (await client.post(CHAT, json=body)).json()["usage"]
        assert second["prompt_tokens_details"]["cached_tokens"] == second["prompt_tokens"] - 1
        lines = []
        async with client.stream("POST", CHAT, json={**body, "stream": True,
                                                     "stream_options": {"include_usage": True}}) as resp:
            async for line in resp.aiter_lines():
                lines.append(line)
        import json

        usage = [json.loads(ln[5:])["usage"] for ln in lines if ln.startswith("data: {") and '"usage":{' in ln]
        assert usage and usage[-1]["prompt_tokens_details"]["cached_tokens"] == second["prompt_tokens"] - 1
        text = (await client.post(COMPLETIONS, json={"prompt": "abc " * 100, "max_tokens": 2})).json()
        assert text["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        metrics = (await client.get("/metrics")).text
    values = {ln.split()[0]: float(ln.split()[1]) for ln in metrics.splitlines() if ln.startswith("trio_mlx_prompt_cache")}
    assert values["trio_mlx_prompt_cache_lookups_total"] == 4
    assert values["trio_mlx_prompt_cache_hits_total"] == 2
    assert values["trio_mlx_prompt_cache_hit_tokens_total"] == 2 * (second["prompt_tokens"] - 1)
    assert values["trio_mlx_prompt_cache_bytes"] > 0 and "trio_mlx_prompt_cache_evictions_total" in values
    # the second chat request repeated the first through its system turn: tokenized past it
    reuse = {ln.split()[0]: float(ln.split()[1]) for ln in metrics.splitlines()
             if ln.startswith("trio_mlx_tokenizer_prefix")}
    assert reuse["trio_mlx_tokenizer_prefix_hits_total"] >= 2
    assert reuse["trio_mlx_tokenizer_prefix_tokens_total"] >= 2 * 60


# -- the cache itself (no model): lookups, storing, eviction ---------------------------------


def layers(tokens: list[int], n_layers: int = 2):
    """A stand-in entry: one single-row KVCache per layer, a token's id in its key."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    out = []
    for layer in range(n_layers):
        kv = KVCache()
        kv.keys = mx.array([[[[float(t + layer)] * 4 for t in tokens]]])
        kv.values = kv.keys * 2
        kv.offset = len(tokens)
        out.append(kv)
    return out


def test_lookups_take_the_longest_shared_prefix_and_never_the_last_token():
    from trio_mlx.actor._prompt_cache import PromptCache

    pc = PromptCache(1 << 20)
    a = list(range(10, 110))  # 100 tokens: one whole 64-token block and a part
    assert pc.store(a, layers(a))
    assert pc.fetch([1, 2, 3]) == (None, 0)
    caches, n = pc.fetch(a)  # all of it: but the last token must be prefilled for logits
    assert n == len(a) - 1 and caches is not None and caches[0].offset == n
    assert pc.fetch(a[:70] + [999])[1] == 70  # part of a longer entry
    assert pc.fetch(a[:40] + [999] * 60)[1] == 0  # less than a whole block: a miss
    assert pc.fetch(a + [7, 8])[1] == len(a)  # an entry that is a prefix of the prompt
    view = pc.fetch(a + [7])[0]
    (entry,) = pc._lru.values()
    assert view is not None and view[1].keys is entry.layers[1].keys  # shared, not copied
    assert pc.stats()[:3] == (6, 4, (len(a) - 1) + 70 + len(a) + len(a))
    short = list(range(200, 250))
    assert not pc.store(short, layers(short))  # shorter than a block: never stored


def test_an_admission_looks_each_prompt_up_once_until_the_entries_change(monkeypatch):
    """Split, even, lookup and fetch each ask for a prompt's longest hit: the walk over its
    blocks runs once per prompt, again only after an entry is stored or dropped."""
    from trio_mlx.actor._prompt_cache import PromptCache
    from trio_mlx.actor._protocol import SamplingParams, Submit
    from trio_mlx.actor._reuse import Reuse

    pc = PromptCache(1 << 22)
    a = tuple(range(10, 300))
    assert pc.store(a, layers(a))
    walks = []
    match = pc._match
    monkeypatch.setattr(pc, "_match", lambda tokens: walks.append(len(tokens)) or match(tokens))
    subs = [Submit(rid, a[:n] + (7, 8), 4, SamplingParams(), frozenset()) for rid, n in ((1, 200), (2, 230))]
    reuse = Reuse(pc)
    subs = reuse.split(subs)
    subs, later = reuse.even(subs, 64)
    caches, _, counts = reuse.lookup(subs)
    assert later == [] and caches is not None and counts == [200, 200]  # evened out to the shortest hit
    assert len(walks) == 2
    assert pc.longest(subs[1].prompt)[1] == 230 and len(walks) == 2  # remembered
    assert pc.longest(list(subs[1].prompt))[1] == 230 and len(walks) == 3  # a list may change: walked
    b = a[:230] + (5,) * 100
    assert pc.store(b, layers(b))  # a new entry: what was remembered is walked again
    assert pc.longest(subs[0].prompt)[1] == 200 and len(walks) == 5  # the store walked, then the lookup
    pc.clear()
    assert pc.longest(subs[0].prompt) == (None, 0)


def test_an_entry_that_extends_another_replaces_it_and_a_held_prefix_is_not_stored_twice():
    from trio_mlx.actor._prompt_cache import PromptCache

    pc = PromptCache(1 << 20)
    a = list(range(10, 110))
    pc.store(a, layers(a))
    longer = a + [5, 6, 7]
    assert pc.store(longer, layers(longer))
    assert len(pc) == 1 and pc.nbytes == sum(kv.keys.nbytes * 2 for kv in layers(longer))
    assert not pc.store(a[:80], layers(a[:80]))  # the longer entry serves it already
    assert len(pc) == 1 and pc.fetch(a[:80] + [1])[1] == 80
    other = a[:70] + [300, 301, 302]
    assert pc.store(other, layers(other))  # a branch: both kept
    assert len(pc) == 2


def test_the_byte_bound_evicts_least_recently_used_entries():
    from trio_mlx.actor._prompt_cache import PromptCache

    one = sum(kv.keys.nbytes * 2 for kv in layers(list(range(64))))
    pc = PromptCache(2 * one)
    entries = [[1000 * k + i for i in range(64)] for k in range(1, 4)]
    pc.store(entries[0], layers(entries[0]))
    pc.store(entries[1], layers(entries[1]))
    pc.fetch(entries[0])  # used: the second is now the oldest
    pc.store(entries[2], layers(entries[2]))
    assert len(pc) == 2 and pc.evictions == 1 and pc.nbytes == 2 * one
    assert pc.fetch(entries[1])[1] == 0 and pc.fetch(entries[0])[1] == 63
    big = list(range(5000, 5000 + 3 * 64))
    assert not pc.store(big, layers(big))  # larger than the whole bound: never kept
    assert PromptCache(0).store(big, layers(big)) is False and not PromptCache(0).enabled


def test_memory_pressure_makes_the_cache_give_way(monkeypatch):
    import mlx.core as mx

    from trio_mlx.actor._prompt_cache import PromptCache

    one = sum(kv.keys.nbytes * 2 for kv in layers(list(range(64))))
    pc = PromptCache(10 * one, pressure_bytes=1000 * one)
    for k in range(4):
        pc.store([1000 * k + i for i in range(64)], layers([1000 * k + i for i in range(64)]))
    monkeypatch.setattr(mx, "get_active_memory", lambda: 999 * one)
    assert pc.relieve() == 0 and len(pc) == 4
    monkeypatch.setattr(mx, "get_active_memory", lambda: 1002 * one)
    assert pc.relieve() == 2 * one and len(pc) == 2 and pc.evictions == 2
    monkeypatch.setattr(mx, "get_active_memory", lambda: 5000 * one)
    pc.relieve()
    assert len(pc) == 0 and pc.nbytes == 0


def test_memory_pressure_hands_mlxs_buffer_cache_back_first(monkeypatch):
    """Freed buffers MLX keeps count against the mark: past it they go back (clear_cache),
    even with no entry held (the prompt cache off), before any entry is evicted."""
    import mlx.core as mx

    from trio_mlx.actor._prompt_cache import PromptCache

    cleared: list[int] = []
    monkeypatch.setattr(mx, "clear_cache", lambda: cleared.append(1))
    monkeypatch.setattr(mx, "get_active_memory", lambda: 600)
    monkeypatch.setattr(mx, "get_cache_memory", lambda: 300)
    off = PromptCache(0, pressure_bytes=1000)
    assert off.relieve() == 0 and not cleared  # 900 of 1000: no pressure
    monkeypatch.setattr(mx, "get_cache_memory", lambda: 500)
    assert off.relieve() == 0 and cleared == [1]  # 1100: the buffer cache goes back
    assert PromptCache(0, pressure_bytes=None).relieve() == 0 and cleared == [1]  # the CPU: no mark


def test_the_default_bound_follows_the_device(monkeypatch):
    from trio_mlx.actor import _prompt_cache

    limit, pressure = _prompt_cache.budget(None)  # the CPU here: small, and no pressure mark
    assert 0 < limit <= _prompt_cache.CPU_BYTES and pressure is None
    assert _prompt_cache.budget(0) == (0, None) and _prompt_cache.budget(2.5)[0] == 2_500_000_000
    mx = _prompt_cache.mx
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(mx, "device_info", lambda: {"total_memory": 80 << 30})  # CUDA's key
    assert _prompt_cache.budget(None) == (int((80 << 30) * 0.2), int((80 << 30) * 0.9))
    # Apple silicon: memory shared with the system; pressure counts from Metal's working set
    monkeypatch.setattr(mx, "device_info", lambda: {"memory_size": 64 << 30,
                                                    "max_recommended_working_set_size": 48 << 30})
    assert _prompt_cache.budget(None) == (int((64 << 30) * 0.2), int((48 << 30) * 0.9))
    assert _prompt_cache.budget(0.5) == (500_000_000, int((48 << 30) * 0.9))


async def test_a_request_arriving_while_a_shared_prompt_prefills_finds_it(tiny_model_fp32):
    """Users of one system prompt one after another: the second arrives while the first
    prefills (short of the long-prompt mark, so stored only because the second shares it)."""
    system = ids(180, 21)
    first_prompt, second_prompt = system + ids(8, 1), system + ids(8, 2)
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=4, prefill_batch=1, prefill_step=16) as engine:
        first = engine.generate(first_prompt, max_tokens=30, **GREEDY)
        async with first:
            await until(lambda: first.stage == "prefill")
            out, _, fin = await run(engine, second_prompt, max_tokens=6, **GREEDY)
            await collect(first)
    assert fin.usage.cached_tokens >= len(system)
    assert [out] == await cold_runs(tiny_model_fp32, [(second_prompt, 6)])


def test_lookups_and_stores_agree_with_a_brute_force_search():
    """Random conversations branching inside and across the 64-token blocks: every lookup
    finds the longest prefix any entry shares (a plain scan says which), every entry that
    another extends is gone, and the byte count is the entries' sum."""
    import random

    from trio_mlx.actor import _prompt_cache
    from trio_mlx.actor._prompt_cache import PromptCache

    rng = random.Random(5)
    pc = PromptCache(1 << 30)
    roots = [[rng.randrange(50) for _ in range(rng.randrange(1, 200))] for _ in range(3)]
    for _ in range(150):
        base = rng.choice(roots + [list(k) for k in pc.keys()])
        cut = rng.randrange(0, len(base) + 1)
        seq = base[:cut] + [rng.randrange(50) for _ in range(rng.randrange(0, 150))]
        if rng.random() < 0.5:
            pc.store(seq, layers(seq, n_layers=1))
        query = tuple(seq + [rng.randrange(50) for _ in range(rng.randrange(0, 3))])
        if len(query) < 2:
            continue

        def shared(key: tuple[int, ...], q: tuple[int, ...] = query) -> int:
            return _prompt_cache.common_prefix(q, key, len(q))

        want = max((shared(k) for k in pc.keys()), default=0)
        want = want if want >= _prompt_cache.BLOCK else 0  # whole blocks or nothing
        assert pc.longest(query)[1] == min(want, len(query) - 1)
        keys = pc.keys()
        assert not any(a != b and b[: len(a)] == a for a in keys for b in keys)  # no entry extends another
        assert all(len(k) >= _prompt_cache.BLOCK for k in keys)
        assert pc.nbytes == sum(e.nbytes for e in pc._lru.values())
    assert len(pc) > 5 and max(len(k) for k in pc.keys()) > 3 * _prompt_cache.BLOCK
    pc.clear()
    assert pc.nbytes == 0 and not pc._index and not pc._ends


async def test_under_memory_pressure_the_cache_gives_way_and_requests_are_served(tiny_model_fp32, monkeypatch):
    """A pressure mark of one byte: any memory in use is pressure, so before every group
    prefills the cache lets everything go; requests are served as cold ones."""
    from trio_mlx.actor import _actor

    monkeypatch.setattr(_actor, "budget", lambda gb, share=1.0: (1 << 30, 1))
    prompt = ids(300, 23)
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=4) as engine:
        first, _, _ = await run(engine, prompt, max_tokens=6, **GREEDY)
        assert engine.statistics().prompt_cache_entries == 1
        second, _, fin = await run(engine, prompt, max_tokens=6, **GREEDY)
        s = engine.statistics()
    assert fin.usage.cached_tokens == 0 and fin.finish_reason == "length"
    assert s.prompt_cache_evictions >= 1 and s.prompt_cache_hits == 0
    assert first == second


async def test_a_constrained_request_with_a_hit_gives_the_cold_runs_tokens(tiny_model_fp32):
    """A grammar-masked row entering with cached KV: the mask sees the same context, so the
    tokens (and the JSON they spell) are the cold run's."""
    from integration.test_structured_engine import SCHEMA_FORMAT

    prompt = ids(150, 4)

    async def twice(engine: trio_mlx.Engine) -> list[tuple[list[int], str, int]]:
        out = []
        for _ in range(2):
            got, text, fin = await run(engine, prompt, response_format=SCHEMA_FORMAT, max_tokens=70,
                                       temperature=0)
            out.append((got, text, fin.usage.cached_tokens))
        return out

    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=8, prompt_cache_gb=0) as engine:
        cold = await twice(engine)
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=8) as engine:
        warm = await twice(engine)
    assert [c[:2] for c in cold] == [w[:2] for w in warm]
    assert cold[1][2] == 0 and warm[0][2] == 0 and warm[1][2] >= len(prompt) - 1


async def test_on_the_shape_grid_hits_are_cut_to_its_prefix_and_prefills_run_padded(tiny_model_fp32, monkeypatch):
    """The shape grid (`actor._batch.CausalPrefill`; CUDA's, forced here with a prefix grain
    of 64): a follow-up's hit is cut to a multiple of the grain, every prefill attention
    runs a power-of-two query of at least 128 over contiguous keys of the cached prefix
    plus that query, and every token is the cold run's."""
    from mlx_lm.models import llama

    from trio_mlx.actor import _actor

    monkeypatch.setattr(_actor, "prefill_grid", lambda: True)
    monkeypatch.setattr(_actor, "GRID_PREFIX", 64)
    shapes: list[tuple[int, int]] = []
    sdpa = llama.scaled_dot_product_attention

    def spy(queries, keys, *args, **kwargs):
        if queries.shape[2] > 1:
            shapes.append((queries.shape[2], keys.shape[2]))
        return sdpa(queries, keys, *args, **kwargs)

    monkeypatch.setattr(llama, "scaled_dot_product_attention", spy)
    system = ids(300)
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=8, warmup=False) as engine:
        first, _, f1 = await run(engine, system, max_tokens=12, **GREEDY)
        turn2 = system + first + ids(9, 3)
        shapes.clear()
        second, _, f2 = await run(engine, turn2, max_tokens=12, **GREEDY)
    held = len(system) + len(first)
    assert f2.usage.cached_tokens == held // 64 * 64 > 0
    new = len(turn2) - 1 - f2.usage.cached_tokens  # the last prompt token enters with the first decode step
    assert shapes and set(shapes) == {(128, f2.usage.cached_tokens + 128)} and new <= 128
    assert [first, second] == await cold_runs(tiny_model_fp32, [(system, 12), (turn2, 12)], shared=False)


@pytest.mark.parametrize("actor", ["thread", "process"])
async def test_a_restarted_engine_reads_its_entries_back_from_disk(tiny_model_fp32, tmp_path, actor):
    """The disk tier (`actor/_disk_cache.py`): a clean stop writes the entries under
    cache_dir/prompt-cache/<model>, the next start reads them back, and a follow-up after
    the restart finds the last turn, with the cold run's tokens. A broken file there is
    dropped, and the start goes on. The process actor writes from its own process."""
    system = ids(300)
    options = dict(max_batch=8, cache_dir=tmp_path, prompt_cache_disk_gb=1.0, actor=actor)
    async with trio_mlx.open_engine(tiny_model_fp32, **options) as engine:
        first, _, _ = await run(engine, system, max_tokens=12, **GREEDY)
    (where,) = (tmp_path / "prompt-cache").iterdir()
    assert sorted(f.suffix for f in where.iterdir()) == [".json", ".safetensors"]
    (where / "broken.safetensors").write_bytes(b"not a cache")
    outside = tmp_path / "keep.safetensors"
    outside.write_bytes(b"not the cache's")
    order = json.loads((where / "order.json").read_text())
    (where / "order.json").write_text(json.dumps(["../../keep.safetensors", *order]))  # never followed
    turn2 = system + first + ids(9, 3)
    async with trio_mlx.open_engine(tiny_model_fp32, **options) as engine:
        second, _, fin = await run(engine, turn2, max_tokens=12, **GREEDY)
    assert fin.usage.cached_tokens == len(system) + len(first)
    assert not (where / "broken.safetensors").exists() and outside.exists()
    assert second == (await cold_runs(tiny_model_fp32, [(turn2, 12)]))[0]
    # off by default, and another model reads another folder
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=8, cache_dir=tmp_path) as engine:
        _, _, fin = await run(engine, turn2, max_tokens=2, **GREEDY)
    assert fin.usage.cached_tokens == 0
    from trio_mlx.actor._disk_cache import folder

    assert folder(tmp_path / "prompt-cache", tiny_model_fp32) == where != folder(tmp_path / "prompt-cache", tmp_path)


def test_the_disk_tier_keeps_the_newest_entries_that_fit_its_bound(tmp_path):
    """Written newest first while they fit the disk bound, read back newest first while they
    fit the cache's, in the order they were used."""
    from trio_mlx.actor._disk_cache import load, save
    from trio_mlx.actor._prompt_cache import PromptCache

    cache = PromptCache(1 << 30)
    entries = [tuple(ids(100 + 10 * i, 50 * i)) for i in range(3)]
    for key in entries:
        assert cache.store(key, layers(list(key)))
    cache.fetch(entries[0])  # used last: the newest
    sizes = {e.key: e.nbytes for e in cache.entries()}
    assert save(cache, tmp_path, sizes[entries[0]] + sizes[entries[2]]) == 2
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    back = PromptCache(1 << 30)
    assert load(back, tmp_path, 2) == 2
    assert back.keys() == [entries[2], entries[0]]
    newest = tmp_path / json.loads((tmp_path / "order.json").read_text())[-1]
    small = PromptCache(newest.stat().st_size)  # room for the newest file only
    assert load(small, tmp_path, 2) == 1 and small.keys() == [entries[0]]
    assert load(PromptCache(1 << 30), tmp_path, 3) == 0  # a model of another depth: nothing fits
    assert list(tmp_path.glob("*.safetensors")) == []  # and what does not fit the model is dropped


async def test_a_cache_salt_keeps_prompts_apart_and_the_same_salt_shares(tiny_model_fp32):
    """The prompt cache was an oracle across users: `cached_tokens` told one user how much of
    another's prompt it had guessed. A salt partitions it, as vLLM's `cache_salt`."""
    prompt = ids(200, 3)
    (expected,) = await cold_runs(tiny_model_fp32, [(prompt, 6)])
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=8) as engine:
        cached = {}
        for label, salt in [("alice", "a"), ("bob", "b"), ("shared", None), ("alice again", "a"),
                            ("shared again", None), ("bob again", "b")]:
            got, _, fin = await run(engine, prompt, max_tokens=6, cache_salt=salt, **GREEDY)
            assert got == expected, label  # a hit under a salt computes the cold run's tokens
            cached[label] = fin.usage.cached_tokens
        # the same prompts in two partitions: both entries stay, neither extends the other
        together = [engine.generate(prompt, max_tokens=6, cache_salt=s, **GREEDY) for s in ("c", "d")]
        async with together[0], together[1]:
            pair = [(await collect(st))[2].usage.cached_tokens for st in together]
    full = len(prompt) - 1  # the last prompt token always runs for its logits
    assert cached == {"alice": 0, "bob": 0, "shared": 0, "alice again": full, "shared again": full,
                      "bob again": full}
    assert pair == [0, 0]  # arriving together, neither waited for the other's prefill


async def test_api_keys_keep_their_own_prompt_cache_when_isolated(tiny_model_fp32):
    """`prompt_cache_isolation` "key": two API keys of one server share nothing; one key's
    requests share as before, and a cache_salt partitions a key's part further."""
    text = " ".join(f"w{i}" for i in range(200))
    body = {"prompt": text, "max_tokens": 2, "temperature": 0}

    async def cached(client, key: str, **extra) -> int:
        r = await client.post(COMPLETIONS, json={**body, **extra}, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    async with serve(tiny_model_fp32, api_key="key-one, key-two", prompt_cache_isolation="key") as server, \
            server.client() as client:
        assert await cached(client, "key-one") == 0
        assert await cached(client, "key-two") == 0
        assert await cached(client, "key-one") > 0
        assert await cached(client, "key-two") > 0
        assert await cached(client, "key-one", cache_salt="s") == 0
        assert await cached(client, "key-one", cache_salt="s") > 0
        r = await client.post(COMPLETIONS, json=body, headers={"Authorization": "Bearer key-three"})
        assert r.status_code == 401
    async with serve(tiny_model_fp32, api_key="key-one,key-two") as server, server.client() as client:
        assert await cached(client, "key-one") == 0
        assert await cached(client, "key-two") > 0  # shared: the default, documented
        r = await client.post(CHAT, json={"messages": [{"role": "user", "content": text}], "max_tokens": 2,
                                          "cache_salt": ""}, headers={"Authorization": "Bearer key-one"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
