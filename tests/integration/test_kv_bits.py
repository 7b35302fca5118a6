"""The quantized KV cache (`kv_bits`, actor/_kv_quant.py) on a tiny fp32 llama with a head dim
of 64, on the CPU: greedy tokens are mlx-lm's own `generate_step` with a `QuantizedKVCache` per
layer, alone, in a batch whose rows come and go, through chunked prefill, an abort, a
prompt-cache hit and the process actor; the prompt cache's byte bound counts quantized bytes;
what cannot take it is refused at startup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

import trio_mlx
from integration.test_engine import run, settled, until
from integration.test_speculative import _oracles
from trio_mlx.actor._kv_quant import BatchQuantizedKVCache, RowQuantizedKVCache
from trio_mlx.models import _models, _test_models

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_hd64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _test_models.build_test_model(tmp_path_factory.mktemp("tiny-hd64") / "model", shape="tiny-hd64")


@pytest.fixture(scope="module")
def reference(model_hd64: Path):
    """mlx-lm's greedy tokens with its quantized cache from the first token (None: plain KV)."""
    model, _ = _models.load_model(model_hd64)

    def tokens(prompt: list[int], n: int, bits: int | None, group_size: int = 64, step: int = 2048) -> list[int]:
        cache = None if bits is None else [QuantizedKVCache(group_size=group_size, bits=bits) for _ in model.layers]
        steps = generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache, prefill_step_size=step)
        return [int(t) for t, _ in steps]

    return tokens


def ids(n: int, start: int = 0) -> list[int]:
    return [5 + (start + 7 * i) % 400 for i in range(n)]


@pytest.mark.parametrize(("bits", "group_size", "prefill_step"), [(8, 64, 2048), (4, 32, 64), (4, 64, 100)])
async def test_one_sequence_is_mlx_lms_quantized_cache(model_hd64, reference, bits, group_size, prefill_step):
    """Chunked (prefill_step 64, 100: a 300-token prompt in several steps) or whole."""
    prompt = ids(300)
    async with trio_mlx.open_engine(model_hd64, kv_bits=bits, kv_group_size=group_size,
                                    prefill_step=prefill_step, prompt_cache_gb=0) as engine:
        got, _, fin = await run(engine, prompt, max_tokens=24, **GREEDY)
    assert fin.finish_reason == "length"
    assert got == reference(prompt, 24, bits, group_size)
    if bits == 4:  # quantization does change the tokens of a random model: the cache is in use
        assert got != reference(prompt, 24, None)


@pytest.mark.parametrize("decode_step", ["owned", "mlx"])
async def test_rows_entering_and_leaving_a_batch_each_get_their_own_tokens(model_hd64, reference, decode_step):
    """Mixed lengths, in two waves (the second joins rows already decoding), different
    max_tokens (rows leave at different steps), one aborted mid-decode: every finished row
    is mlx-lm's tokens for its prompt alone."""
    jobs = [(ids(40 + 37 * i, 11 * i), 10 + 5 * i) for i in range(6)]
    async with trio_mlx.open_engine(model_hd64, kv_bits=4, kv_group_size=32, max_batch=8, prefill_step=128,
                                    decode_step=decode_step) as engine:
        got: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            prompt, n = jobs[i]
            got[i], _, _ = await run(engine, prompt, max_tokens=n, **GREEDY)

        async def aborted() -> None:
            async with engine.generate(ids(90, 5), max_tokens=400, **GREEDY) as events:
                async for _ in events:
                    if engine.statistics().decoding >= 3:
                        return  # leaves mid-decode: its row is removed beside the others

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i)
            nursery.start_soon(aborted)
            await until(lambda: engine.statistics().decoding >= 2)
            for i in range(3, 6):
                nursery.start_soon(one, i)
        assert engine.statistics().aborts_by_stage == {"decode": 1}
    alone = [reference(p, n, 4, 32) for p, n in jobs]
    assert [got[i] for i in range(6)] == alone
    assert alone != [reference(p, n, None) for p, n in jobs]  # 4 bits change tokens: the cache is in use


async def test_prompts_joining_a_chunked_prefill_under_way(model_hd64, reference):
    """A long prompt prefilled in chunks of 64 while two short ones arrive (they join its
    prompt batch, left-padded, or wait for it): each is its alone tokens."""
    jobs = [(ids(700, 1), 12), (ids(70, 2), 9), (ids(150, 3), 7)]
    async with trio_mlx.open_engine(model_hd64, kv_bits=4, kv_group_size=64, prefill_step=64,
                                    prompt_cache_gb=0) as engine:
        got: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            got[i], _, _ = await run(engine, jobs[i][0], max_tokens=jobs[i][1], **GREEDY)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0)
            await until(lambda: engine.statistics().prefilling == 1)
            nursery.start_soon(one, 1)
            nursery.start_soon(one, 2)
    assert [got[i] for i in range(3)] == [reference(p, n, 4) for p, n in jobs]


async def test_a_prompt_cache_hit_gives_a_cold_runs_tokens(model_hd64, reference):
    """A follow-up turn hits the whole last turn (stored quantized), another prompt a prefix of
    it: each is mlx-lm's cold run, since a token's quantized KV depends on the tokens before it
    alone."""
    system = ids(300, 3)
    async with trio_mlx.open_engine(model_hd64, kv_bits=4, kv_group_size=32, max_batch=4) as engine:
        first, _, f1 = await run(engine, system, max_tokens=12, **GREEDY)
        turn2 = system + first + ids(20, 9)
        second, _, f2 = await run(engine, turn2, max_tokens=12, **GREEDY)
        other = system[:200] + ids(30, 17)
        third, _, f3 = await run(engine, other, max_tokens=12, **GREEDY)
        stats = engine.statistics()
    assert f1.usage.cached_tokens == 0 and f2.usage.cached_tokens == len(system) + len(first)
    assert f3.usage.cached_tokens == 200
    assert stats.prompt_cache_hits == 2
    assert [first, second, third] == [reference(p, 12, 4, 32) for p in (system, turn2, other)]


async def test_a_row_the_generator_ends_itself_is_stored_quantized(model_hd64, reference):
    """mlx-lm's own step with no retirement: the generator ends the row at max_tokens and
    extracts its cache (`BatchQuantizedKVCache.extract`), which the prompt cache keeps."""
    system = ids(300, 6)
    async with trio_mlx.open_engine(model_hd64, kv_bits=8, decode_step="mlx", retire_steps=0) as engine:
        first, _, _ = await run(engine, system, max_tokens=10, **GREEDY)
        turn2 = system + first + ids(12, 2)
        second, _, fin = await run(engine, turn2, max_tokens=10, **GREEDY)
    assert fin.usage.cached_tokens == len(system) + len(first)  # the extracted row, answer and all
    assert [first, second] == [reference(system, 10, 8), reference(turn2, 10, 8)]


async def test_speculative_decoding_keeps_the_tokens(model_hd64, reference):
    """Prompt lookup (drafts rejected: the quantized KV trimmed back) and a draft model (the
    model itself at full precision, its drafts often kept) give the plain step's tokens."""
    prompt = [5 + (7 * i) % 50 for i in range(200)]  # repetitive: prompt lookup drafts
    for knobs in ({"speculative": "ngram"}, {"draft_model": str(model_hd64)}):
        async with trio_mlx.open_engine(model_hd64, kv_bits=4, kv_group_size=32, **knobs) as engine:
            got, _, fin = await run(engine, prompt, max_tokens=60, **GREEDY)
        assert fin.usage.draft_tokens > 0, knobs
        assert got == reference(prompt, 60, 4, 32), knobs


async def test_speculative_decoding_in_a_batch_keeps_each_rows_tokens(model_hd64, reference, monkeypatch):
    """Two repetitive prompts of different lengths decoding side by side, speculating: each
    row's quantized KV rolled back past its own rejected drafts (`_spec_step.rollback`), the
    tokens mlx-lm's with its quantized cache, and both rows' drafts counted. Prompt lookup
    drafts each row's own tokens with a third of them spoiled (this random model's text
    does not copy its prompt, so its own lookup would seldom draft)."""
    prompts = [[5 + (7 * i) % 50 for i in range(200)], [9 + (5 * i) % 40 for i in range(150)]]
    _oracles(monkeypatch, {tuple(p): reference(p, 40, 4, 32) for p in prompts}, spoil=0.3)
    for knobs in ({"speculative": "ngram"}, {"draft_model": str(model_hd64)}):
        out: list[Any] = [None, None]
        async with trio_mlx.open_engine(model_hd64, kv_bits=4, kv_group_size=32, **knobs) as engine:

            async def one(i: int, engine: trio_mlx.Engine = engine, out: list[Any] = out) -> None:
                out[i] = await run(engine, prompts[i], max_tokens=40, **GREEDY)

            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(one, i)
        for prompt, (got, _, fin) in zip(prompts, out, strict=True):
            assert fin.usage.draft_tokens > 0, knobs
            assert got == reference(prompt, 40, 4, 32), knobs


def kv_bytes(tokens: int, bits: int | None, group_size: int = 64) -> int:
    """The tiny-hd64 model's KV of `tokens` tokens: 2 layers, keys and values, 1 KV head of
    64 float32 values; quantized, `bits` per value plus a float32 scale and bias per group."""
    per_vector = 64 * 4 if bits is None else 64 * bits // 8 + 2 * 4 * (64 // group_size)
    return tokens * 2 * 2 * per_vector


async def test_the_prompt_cache_holds_and_bounds_quantized_bytes(model_hd64):
    """An entry weighs its quantized bytes, so a bound that one plain entry exceeds holds it."""
    prompt, n = ids(300, 1), 8
    bound = kv_bytes(prompt_len := len(prompt) + n, None) // 2  # the plain entry does not fit; 8 bits do
    assert kv_bytes(prompt_len, 8) < bound
    held = {}
    for bits in (None, 8):
        async with trio_mlx.open_engine(model_hd64, kv_bits=bits, prompt_cache_gb=bound / 1e9) as engine:
            await run(engine, prompt, max_tokens=n, **GREEDY)
            await settled(engine)
            s = engine.statistics()
            held[bits] = (s.prompt_cache_entries, s.prompt_cache_bytes)
    # the finished sequence: its prompt and its whole answer
    assert held == {None: (0, 0), 8: (1, kv_bytes(len(prompt) + n, 8))}


async def test_the_disk_tier_keeps_quantized_entries_apart(model_hd64, reference, tmp_path):
    """Written quantized at a clean stop, read back quantized at the next start (a follow-up
    finds its last turn, with the cold run's tokens), in a folder of their own: a plain-KV
    engine of the same model finds nothing there."""
    system = ids(300, 4)
    options = dict(cache_dir=tmp_path, prompt_cache_disk_gb=1.0, kv_bits=4, kv_group_size=32)
    async with trio_mlx.open_engine(model_hd64, **options) as engine:
        first, _, _ = await run(engine, system, max_tokens=12, **GREEDY)
    turn2 = system + first + ids(9, 3)
    async with trio_mlx.open_engine(model_hd64, **options) as engine:
        second, _, fin = await run(engine, turn2, max_tokens=12, **GREEDY)
    assert fin.usage.cached_tokens == len(system) + len(first)
    assert second == reference(turn2, 12, 4, 32)
    async with trio_mlx.open_engine(model_hd64, cache_dir=tmp_path, prompt_cache_disk_gb=1.0) as engine:
        _, _, plain = await run(engine, turn2, max_tokens=2, **GREEDY)
    assert plain.usage.cached_tokens == 0
    assert len(list((tmp_path / "prompt-cache").iterdir())) == 2


async def test_the_process_actor_takes_kv_bits(model_hd64, reference):
    prompt = ids(120, 2)
    async with trio_mlx.open_engine(model_hd64, actor="process", kv_bits=8, warmup=False) as engine:
        got, _, _ = await run(engine, prompt, max_tokens=10, **GREEDY)
    assert got == reference(prompt, 10, 8)


async def test_a_group_size_that_does_not_divide_the_head_dim_stops_the_start(tiny_model_fp32):
    """The tiny model's head dim is 16: no group size divides it."""
    with pytest.raises(trio_mlx.ModelLoadError, match="kv_group_size 32 must divide the model's head dim"):
        async with trio_mlx.open_engine(tiny_model_fp32, kv_bits=8, kv_group_size=32):
            pass


def test_a_batch_cache_moves_rows_as_their_own_quantized_kv():
    """merge, prepare/finalize (right padding), extend (with rows holding nothing too), filter
    and extract keep each row's quantized KV exactly what quantizing that row's keys alone
    gives."""
    g, bits = 32, 4
    rows = [mx.random.normal((1, 2, n, 64), key=mx.random.key(n)) for n in (5, 9, 3, 7)]

    def own(x):
        c = RowQuantizedKVCache(g, bits)
        c.update_and_fetch(x, x)
        return c

    a = RowQuantizedKVCache.merge([own(rows[0]), own(rows[1])])
    assert isinstance(a, BatchQuantizedKVCache) and a.bits == bits and a.group_size == g
    b = BatchQuantizedKVCache([0, 0], g, bits)  # a right-padded prefill of two rows
    b.prepare(lengths=[3, 7], right_padding=[4, 0])
    b.update_and_fetch(mx.concatenate([mx.pad(rows[2], [(0, 0), (0, 0), (0, 4), (0, 0)]), rows[3]]),
                       mx.concatenate([mx.pad(rows[2], [(0, 0), (0, 0), (0, 4), (0, 0)]), rows[3]]))
    b.finalize()
    a.extend(b)
    a.extend(BatchQuantizedKVCache([0], g, bits))  # a row with nothing yet (a prompt joining a prefill)
    assert a.keys[0].shape[0] == 5 and a.left_padding.tolist()[4] == a._idx
    a.filter([0, 2, 3])
    for i, x in zip(range(3), (rows[0], rows[2], rows[3]), strict=True):
        got = a.extract(i)
        want = mx.quantize(x, group_size=g, bits=bits)
        assert got.offset == x.shape[2]
        for u, v in zip(got.keys, want, strict=True):
            assert mx.array_equal(u, v)
    assert a.nbytes == sum(t.nbytes for t in (*a.keys, *a.values))


def test_the_mlx_lm_behaviours_it_relies_on(model_hd64):
    """mlx-lm 0.32's pieces the quantized cache plugs into: `BatchGenerator.insert` makes a
    sequence's caches with `make_prompt_cache`, which asks the model (`CausalPrefill.make_cache`);
    its batches merge through the first cache's class (`merge`); its attention takes the
    quantized path for a cache with `bits`."""
    from mlx_lm.generate import _merge_caches
    from mlx_lm.models import base
    from mlx_lm.models.cache import make_prompt_cache

    from trio_mlx.actor._batch import CausalPrefill

    model, _ = _models.load_model(model_hd64)
    rows = [make_prompt_cache(CausalPrefill(model, kv=(32, 4))) for _ in range(2)]
    assert all(type(c) is RowQuantizedKVCache and (c.group_size, c.bits) == (32, 4) for r in rows for c in r)
    batch = _merge_caches(rows)
    assert all(type(c) is BatchQuantizedKVCache for c in batch)
    x = mx.random.normal((2, 1, 3, 64), key=mx.random.key(1))
    keys, values = batch[0].update_and_fetch(x, x)
    q = mx.random.normal((2, 2, 3, 64), key=mx.random.key(2))
    # (copies of the queries: mlx-lm's quantized attention scales them in place)
    got = base.scaled_dot_product_attention(q * 1, keys, values, cache=batch[0], scale=0.125, mask="causal")
    want = base.quantized_scaled_dot_product_attention(q * 1, keys, values, scale=0.125, mask="causal",
                                                       group_size=32, bits=4)
    assert mx.array_equal(got, want)


def test_a_model_whose_attention_takes_no_quantized_keys_is_refused():
    """One token through the model at load: an attention outside mlx-lm's shared function
    (here one that reads the keys as an array) stops the start, naming kv_bits."""
    from trio_mlx.actor import ActorConfig
    from trio_mlx.actor._actor import Actor
    from trio_mlx.actor._loading import kv_quantization

    class OwnAttention:
        layers = [None, None]  # two plain KV caches (mlx-lm's default for a model without make_cache)

        def __call__(self, inputs, cache):
            x = mx.ones((1, 1, 1, 64))
            keys, _ = cache[0].update_and_fetch(x, x)
            return keys @ keys.swapaxes(-1, -2)  # a tuple has no matmul

    actor = Actor(ActorConfig(Path("m"), trio_mlx.ActorTuning(kv_bits=8)), None)  # type: ignore[arg-type]
    actor._model = OwnAttention()
    with pytest.raises(ValueError, match="kv_bits: this model does not run with a quantized KV cache"):
        kv_quantization(actor._model, {"hidden_size": 128, "num_attention_heads": 2}, actor.config.tuning)


@pytest.mark.parametrize("mask", ["causal", "array", None])
def test_the_dequantized_attention_is_mlx_lms_quantized_attention(mask):
    """`dequantized_attention` (CUDA's path: the keys and values dequantized, then MLX's fused
    attention, grouped-query heads included) computes what mlx-lm's quantized attention computes."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    from trio_mlx.actor._kv_quant import dequantized_attention

    mx.random.seed(5)
    queries = mx.random.normal((2, 8, 5, 64))
    keys, values = mx.random.normal((2, 2, 37, 64)), mx.random.normal((2, 2, 37, 64))
    q_keys, q_values = mx.quantize(keys, group_size=32, bits=4), mx.quantize(values, group_size=32, bits=4)
    m: Any = mask
    if mask == "array":  # the second row left-padded by 6, as a batch's mask has it
        m = mx.broadcast_to((mx.arange(37) >= mx.array([0, 6])[:, None])[:, None, None, :], (2, 1, 5, 37))
    # each its own copy of the queries: mlx-lm scales its argument in place (`queries *= scale`)
    want = quantized_scaled_dot_product_attention(queries * 1, q_keys, q_values, 0.125, m, group_size=32, bits=4)
    got = dequantized_attention(queries * 1, q_keys, q_values, 0.125, m, group_size=32, bits=4)
    assert got.shape == want.shape == (2, 8, 5, 64)
    assert mx.allclose(got, want, atol=1e-5).item()


async def test_with_dequantized_attention_the_engine_still_gives_mlx_lms_tokens(model_hd64, reference, monkeypatch):
    """Where the actor attends over dequantized keys and values (CUDA, where `quantized_matmul`
    has no kernel for the attention's shapes: here it raises as there), a batch of rows of different lengths
    (masks with padding), one prefilled in chunks, still gets mlx-lm's own tokens."""
    from mlx_lm.models import base

    jobs = [(ids(300, 3), 16), (ids(41, 8), 20), (ids(97, 2), 12)]
    want = [reference(prompt, n, 4, 32) for prompt, n in jobs]  # before the swap: mlx-lm's own attention
    monkeypatch.setattr(base, "quantized_scaled_dot_product_attention", base.quantized_scaled_dot_product_attention)
    from trio_mlx.actor import _loading

    monkeypatch.setattr(_loading.mx.cuda, "is_available", lambda: True)

    def no_kernel(*args: Any, **kwargs: Any) -> Any:  # as MLX 0.32.4's CUDA answers mlx-lm's shapes
        raise RuntimeError("[quantized_matmul] No implementation for problem shape: 4x1x64x8")

    monkeypatch.setattr(mx, "quantized_matmul", no_kernel)
    async with trio_mlx.open_engine(model_hd64, kv_bits=4, kv_group_size=32, max_batch=4, prefill_step=128,
                                    warmup=False, prompt_cache_gb=0) as engine:
        assert base.quantized_scaled_dot_product_attention.__name__ == "dequantized_attention"
        got: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            prompt, n = jobs[i]
            got[i], _, _ = await run(engine, prompt, max_tokens=n, **GREEDY)

        async with trio.open_nursery() as nursery:
            for i in range(len(jobs)):
                nursery.start_soon(one, i)
    assert [got[i] for i in range(len(jobs))] == want
