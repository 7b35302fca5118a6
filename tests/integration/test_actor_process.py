"""The GPU actor in a child process (`actor="process"`): the same answers as the thread actor,
aborts, load failures, a child that dies, and a child that never outlives its engine.

Here the engine over the process actor; the pipe link alone: tests/unit/test_actor_process.py;
a parent killed with SIGKILL: tests/system/test_actor_process.py.
"""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path

import pytest
import trio
from processes import alive

import trio_mlx
from integration.test_engine import PROMPTS, collect, run, until


async def answers(model: Path, actor: str) -> tuple[dict[str, list[int]], int]:
    """Greedy and seeded answers to PROMPTS, more requests than batch slots; and the actor's pid."""
    out: dict[str, list[int]] = {}

    async def one(key: str, prompt: str, **opts) -> None:
        ids, _, fin = await run(engine, prompt, max_tokens=12, ignore_eos=True, **opts)
        assert fin.finish_reason == "length"
        out[key] = ids

    async with trio_mlx.open_engine(model, actor=actor, max_batch=3) as engine:
        assert engine.info is not None
        async with trio.open_nursery() as nursery:
            for i, p in enumerate(PROMPTS):
                nursery.start_soon(functools.partial(one, f"greedy {i}", p, temperature=0))
                nursery.start_soon(functools.partial(one, f"seeded {i}", p, temperature=0.9, seed=i))
        stats = engine.statistics()
        assert stats.requests_finished == 2 * len(PROMPTS) and stats.active == 0
        return out, engine.info.pid


async def test_the_process_actor_gives_the_thread_actors_answers_and_exits_with_the_engine(tiny_model_fp32):
    with trio.fail_after(60):
        by_thread, thread_pid = await answers(tiny_model_fp32, "thread")
        by_process, process_pid = await answers(tiny_model_fp32, "process")
    assert thread_pid == os.getpid() and process_pid != os.getpid()
    assert by_process == by_thread and len(by_process) == 2 * len(PROMPTS)
    assert not alive(process_pid)


async def test_the_process_actor_uses_the_servers_blas(tiny_model_fp32):
    # Its child imported mlx.core (through the actor) before trio_mlx.models could load
    # OpenBLAS under it, and ran the CPU wheel's reference BLAS: "mlx was imported before
    # trio_mlx.models".
    from trio_mlx import models

    async with trio_mlx.open_engine(tiny_model_fp32, actor="process", warmup=False) as engine:
        assert engine.info is not None
        here = models.cpu_blas_status()
        if engine.info.device.startswith("Device(gpu"):
            pytest.skip("the BLAS is the CPU's")
        assert "imported before" not in engine.info.blas, engine.info.blas
        assert engine.info.blas == here.description, (engine.info.blas, here.description)


async def test_an_abort_reaches_the_process_actor_and_frees_the_slot(tiny_model_fp32):
    with trio.fail_after(60):
        async with trio_mlx.open_engine(tiny_model_fp32, actor="process", max_batch=1) as engine:
            async with engine.generate("long", max_tokens=900, ignore_eos=True) as events:
                seen = 0
                async for _ in events:
                    seen += 1
                    if seen == 3:
                        break
            # the one slot is free again: the next request runs to its end
            ids, _, fin = await run(engine, "next", max_tokens=5, ignore_eos=True)
            assert fin.finish_reason == "length" and len(ids) == 5
            await until(lambda: engine.statistics().active == 0)
            stats = engine.statistics()
            assert stats.aborts_by_stage == {"decode": 1} and stats.aborts_by_cause == {"cancelled": 1}
            assert stats.generated_tokens < 100  # the aborted one stopped long before its 900


async def test_a_model_the_process_actor_cannot_load_raises_model_load_error(tmp_path, tiny_model_fp32):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model_fp32.iterdir():  # the tokenizer loads (in this process); the weights do not
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    with trio.fail_after(60), pytest.raises(trio_mlx.ModelLoadError, match="could not load the model"):
        async with trio_mlx.open_engine(broken, actor="process"):
            pass


async def test_a_killed_actor_process_ends_every_waiter_and_breaks_the_engine(tiny_model_fp32):
    with trio.fail_after(60):
        async with trio_mlx.open_engine(tiny_model_fp32, actor="process", max_batch=2, restart_limit=0) as engine:
            assert engine.info is not None
            results = []

            async def wait_one(prompt: str) -> None:
                async with engine.generate(prompt, max_tokens=900, ignore_eos=True) as events:
                    results.append(await collect(events))

            async with trio.open_nursery() as nursery:
                for p in PROMPTS[:3]:  # two decoding, one waiting
                    nursery.start_soon(wait_one, p)
                await until(lambda: engine.statistics().decoding == 2)
                # queued, or prefilled in the prompt batch if it arrived while the second
                # prefilled (test_engine's max_batch test pins that order)
                stats = engine.statistics()
                assert stats.queued + stats.prefilling == 1
                os.kill(engine.info.pid, signal.SIGKILL)
            assert [fin.finish_reason for _, _, fin in results] == ["error"] * 3
            assert all("actor" in (fin.error or "") for _, _, fin in results)
            assert engine.state == "broken"
            with pytest.raises(trio_mlx.EngineBrokenError):
                await run(engine, "after", max_tokens=2)
