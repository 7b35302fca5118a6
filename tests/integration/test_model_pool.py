"""Several real tiny models on one GPU thread (`engine/_pool.py`, `actor/_host.py`): each
answers as it does served alone (greedy, token for token), requests that come while their model
loads wait for that load, one unloaded for a third frees its arrays, and a stream of one model
goes on across another's load. The pool's rules over the fake actor: tests/unit/test_model_pool.py."""

from __future__ import annotations

import mlx.core as mx
import trio
import trio.lowlevel

import trio_mlx
from trio_mlx.engine import ModelPool
from trio_mlx.models import _test_models

PROMPTS = ["The quick brown fox", "Once upon a time", "1 2 3 4"]


async def greedy(engine: trio_mlx.Engine, prompt: str, n: int = 12) -> list[int]:
    ids: list[int] = []
    async with engine.generate(prompt, max_tokens=n, ignore_eos=True, temperature=0.0) as events:
        async for ev in events:
            if isinstance(ev, trio_mlx.TextDelta):
                ids += ev.token_ids
    return ids


async def test_models_served_together_answer_as_each_does_alone(tmp_path):
    paths = {name: _test_models.build_test_model(tmp_path / name, seed=seed)
             for name, seed in (("one", 1), ("two", 2), ("three", 3))}
    alone: dict[tuple[str, str], list[int]] = {}
    for name, path in paths.items():
        async with trio_mlx.open_engine(path, max_batch=8) as engine:
            for prompt in PROMPTS:
                alone[name, prompt] = await greedy(engine, prompt)
            assert engine.info is not None
            cache_alone = engine.info.prompt_cache_bytes
    assert alone["one", PROMPTS[0]] != alone["two", PROMPTS[0]]  # the models differ

    pool = ModelPool(paths, max_loaded=2, engine_options={"max_batch": 8})
    together: dict[tuple[str, str], list[int]] = {}

    async def ask(name: str, prompt: str) -> None:
        async with pool.use(name) as engine:
            stream = engine.generate(prompt, max_tokens=12, ignore_eos=True, temperature=0.0)
            await stream.__aenter__()
        try:
            ids: list[int] = []
            async for ev in stream:
                if isinstance(ev, trio_mlx.TextDelta):
                    ids += ev.token_ids
            together[name, prompt] = ids
        finally:
            await stream.__aexit__(None, None, None)

    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        with trio.fail_after(120):
            async with trio.open_nursery() as batch:  # one and two at once, interleaved step by step
                for prompt in PROMPTS:
                    for name in ("one", "two"):
                        batch.start_soon(ask, name, prompt)
            one = pool.engine("one")
            assert one is not None and one.info is not None
            thread = one.info.thread_id
            two = pool.engine("two")
            assert two is not None and two.info is not None and two.info.thread_id == thread
            # two may be loaded at once: each prompt cache takes half of one model's default bound
            assert one.info.prompt_cache_bytes == two.info.prompt_cache_bytes == int(cache_alone * 0.5) > 0
            await ask("one", PROMPTS[0])  # two is now the least recently used, and idle
            before = mx.get_active_memory()
            for prompt in PROMPTS:
                await ask("three", prompt)
            states = {s.name: s.state for s in pool.status()}
            assert states == {"one": "loaded", "two": "unloaded", "three": "loaded"}
            # two's arrays are gone, three's came: the same shape, so no more memory than before,
            # once three's last rows have left its batch (just after their last tokens went out)
            with trio.fail_after(10):
                while mx.get_active_memory() > before:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            three = pool.engine("three")
            assert three is not None and three.info is not None and three.info.thread_id == thread
        await pool.aclose()
        nursery.cancel_scope.cancel()
    for key in [(n, p) for n in ("one", "two", "three") for p in PROMPTS]:
        assert together[key] == alone[key], key


async def test_a_stream_goes_on_across_another_model_s_load(tmp_path):
    """The load runs on the GPU thread, so the stream's steps pause meanwhile; none of its
    tokens is lost or changed, and a request that comes during the load waits for it."""
    paths = {name: _test_models.build_test_model(tmp_path / name, seed=seed) for name, seed in (("one", 1), ("two", 2))}
    alone = {}
    for name, path in paths.items():
        async with trio_mlx.open_engine(path, max_batch=8) as engine:
            alone[name] = await greedy(engine, PROMPTS[0], 48)
    pool = ModelPool(paths, max_loaded=2, engine_options={"max_batch": 8})
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        with trio.fail_after(120):
            async with pool.use("one") as engine:
                stream = engine.generate(PROMPTS[0], max_tokens=48, ignore_eos=True, temperature=0.0)
                await stream.__aenter__()
            got: dict[str, list[int]] = {"one": [], "two": []}
            try:
                async for ev in stream:
                    if isinstance(ev, trio_mlx.TextDelta):
                        got["one"] += ev.token_ids
                        if len(got["one"]) >= 4:
                            break
                async with trio.open_nursery() as both:

                    async def two(key: str) -> None:
                        async with pool.use("two") as engine:
                            got[key] = await greedy(engine, PROMPTS[0], 48)

                    both.start_soon(two, "two")
                    await trio.lowlevel.checkpoint()
                    both.start_soon(two, "two again")  # comes while two loads: waits for the same load
                    async for ev in stream:
                        if isinstance(ev, trio_mlx.TextDelta):
                            got["one"] += ev.token_ids
            finally:
                await stream.__aexit__(None, None, None)
        assert [s.loads for s in pool.status()] == [1, 1]
        await pool.aclose()
        nursery.cancel_scope.cancel()
    assert got == {"one": alone["one"], "two": alone["two"], "two again": alone["two"]}
