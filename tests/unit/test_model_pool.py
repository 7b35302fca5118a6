"""Several models on one GPU thread (`engine/_pool.py`, `actor/_host.py`), over `FakeActor`:
loads on first use, the least recently used idle model unloaded under the bound, a request
that arrives during a load waiting for it, and the refusal when every loaded model is busy.
Real tiny models: tests/integration/test_model_pool.py; the host alone: test_actor_host.py."""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
from collections.abc import AsyncIterator

import pytest
import trio

import trio_mlx
from trio_mlx._errors import (
    ModelBusyError,
    ModelCapacityError,
    ModelLoadError,
    ModelLoadTimeoutError,
)
from trio_mlx.actor import FakeActor
from trio_mlx.engine import ModelPool, find_models
from trio_mlx.engine._pool import weight_bytes

# Each fake model answers with a script of its own (its name's letters), so an answer says which
# model gave it.
SCRIPTS = {"alpha": [10, 11, 12], "beta": [20, 21, 22], "gamma": [30, 31, 32]}


@pytest.fixture
def folder(tmp_path, tiny_model_fp32):
    """A folder of three model folders (copies of the tiny model: the fake reads only the tokenizer)."""
    for name in SCRIPTS:
        shutil.copytree(tiny_model_fp32, tmp_path / name)
    (tmp_path / "notes").mkdir()  # not a model: no config.json
    return tmp_path


class Actors:
    """The fake actors a pool's host made, by model name, with the threads they started on."""

    def __init__(self, **options):
        self.made: list[tuple[str, FakeActor]] = []
        self.threads: set[int] = set()
        self.options = options

    def __call__(self, config, link):
        name = config.model_path.name
        actor = FakeActor(config, link, reply=lambda prompt: SCRIPTS[name], **self.options.get(name, {}))
        self.made.append((name, actor))
        start = actor.start

        def started():
            self.threads.add(threading.get_ident())
            start()

        actor.start = started  # type: ignore[method-assign]
        return actor

    def loads(self, name: str) -> int:
        return sum(1 for n, _ in self.made if n == name)


@contextlib.asynccontextmanager
async def running(pool: ModelPool) -> AsyncIterator[None]:
    """`pool` running in a nursery of its own, closed and the nursery cancelled once the
    test's body is through."""
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        yield
        await pool.aclose()
        nursery.cancel_scope.cancel()


async def answer(engine: trio_mlx.Engine, n: int = 3) -> list[int]:
    ids: list[int] = []
    async with engine.generate("hi", max_tokens=n, ignore_eos=True) as events:
        async for ev in events:
            if isinstance(ev, trio_mlx.TextDelta):
                ids += ev.token_ids
    return ids


async def ask(pool: ModelPool, results: list[list[int]], name: str = "alpha") -> None:
    """One request for `name` through the pool; its answer's ids into `results`."""
    async with pool.use(name) as engine:
        results.append(await answer(engine))


def test_find_models_names_each_model_folder(folder, tiny_model_fp32):
    assert find_models([str(folder)]) == {name: str(folder / name) for name in sorted(SCRIPTS)}
    assert find_models([str(folder / "beta"), "x=some/hub-id"]) == {"beta": str(folder / "beta"),
                                                                    "x": "some/hub-id"}
    with pytest.raises(ValueError, match="two models are named 'beta'"):
        find_models([str(folder), str(folder / "beta")])
    with pytest.raises(ValueError, match="no model folder"):
        find_models([str(folder / "notes")])


async def test_two_models_answer_side_by_side_on_one_thread(folder):
    actors = Actors()
    pool = ModelPool(find_models([str(folder)]), max_loaded=2, make_actor=actors)
    async with running(pool):
        assert pool.engine("alpha") is None  # nothing loads before it is asked for
        results: dict[str, list[int]] = {}

        async def ask(name: str) -> None:
            async with pool.use(name) as engine:
                results[name] = await answer(engine)

        with trio.fail_after(20):
            async with trio.open_nursery() as inner:
                for name in ("alpha", "beta", "alpha", "beta"):
                    inner.start_soon(ask, name)
        assert results == {"alpha": SCRIPTS["alpha"], "beta": SCRIPTS["beta"]}
        assert actors.loads("alpha") == actors.loads("beta") == 1
        assert len(actors.threads) == 1 and actors.threads == {pool.host.thread_id}
        assert {s.name: s.state for s in pool.status()} == {"alpha": "loaded", "beta": "loaded",
                                                            "gamma": "unloaded"}


async def test_the_least_recently_used_idle_model_is_unloaded_for_a_third(folder):
    actors = Actors()
    pool = ModelPool(find_models([str(folder)]), max_loaded=2, make_actor=actors)
    async with running(pool):
        with trio.fail_after(20):
            for name in ("alpha", "beta", "alpha"):  # beta is now the least recently used
                async with pool.use(name) as engine:
                    assert await answer(engine) == SCRIPTS[name]
            async with pool.use("gamma") as engine:
                assert await answer(engine) == SCRIPTS["gamma"]
        states = {s.name: s.state for s in pool.status()}
        assert states == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}
        beta = [a for n, a in actors.made if n == "beta"]
        assert len(beta) == 1 and beta[0].stopped  # freed on the host
        with trio.fail_after(20):  # and beta comes back on demand, in alpha's place now
            async with pool.use("beta") as engine:
                assert await answer(engine) == SCRIPTS["beta"]
        assert actors.loads("beta") == 2
        assert {s.name: s.state for s in pool.status()}["alpha"] == "unloaded"


async def test_a_request_that_comes_during_a_load_waits_for_it(folder, monkeypatch, caplog):
    from trio_mlx.engine import _pool

    monkeypatch.setattr(_pool, "_PROGRESS_EVERY", 0.2)
    caplog.set_level(logging.INFO, "trio_mlx.engine")
    actors = Actors(alpha={"load_seconds": 0.5})
    pool = ModelPool(find_models([str(folder)]), max_loaded=1, make_actor=actors)
    async with running(pool):
        results: list[list[int]] = []

        with trio.fail_after(20):
            async with trio.open_nursery() as inner:
                inner.start_soon(ask, pool, results)
                await trio.sleep(0.1)  # the load has begun
                assert {s.name: s.state for s in pool.status()}["alpha"] == "loading"
                inner.start_soon(ask, pool, results)
        assert results == [SCRIPTS["alpha"]] * 2
        assert actors.loads("alpha") == 1
        assert "a request for the model 'alpha' waits for its load" in caplog.text  # its progress line


async def test_no_idle_model_to_unload_is_a_refusal_with_a_retry_time(folder):
    actors = Actors(alpha={"step_seconds": 0.01})
    pool = ModelPool(find_models([str(folder)]), max_loaded=1, make_actor=actors, retry_after=7)
    async with running(pool):
        with trio.fail_after(20):
            async with pool.use("alpha") as engine:
                stream = engine.generate("hi", max_tokens=200, ignore_eos=True)
            async with stream as events:  # alpha has a request in flight: it is not idle
                with pytest.raises(ModelCapacityError, match="every one is serving requests") as caught:
                    async with pool.use("beta"):
                        pass
                assert caught.value.retry_after == 7
                async for _ in events:
                    break
            # alpha idle again (its request ended): beta loads in its place
            async with pool.use("beta") as engine:
                assert await answer(engine) == SCRIPTS["beta"]
        assert {s.name: s.state for s in pool.status()}["alpha"] == "unloaded"


async def test_a_model_that_fails_to_load_fails_its_requests_and_not_the_others(folder):
    actors = Actors(beta={"load_seconds": -1})  # FakeActor sleeps: a negative time raises
    pool = ModelPool(find_models([str(folder)]), max_loaded=2, make_actor=actors)
    async with running(pool):
        with trio.fail_after(20):
            with pytest.raises(ModelLoadError):
                async with pool.use("beta"):
                    pass
            async with pool.use("alpha") as engine:
                assert await answer(engine) == SCRIPTS["alpha"]


async def test_a_byte_bound_unloads_as_the_count_does(folder):
    size = weight_bytes(str(folder / "alpha"))
    assert size > 0 and weight_bytes("some/hub-id") == 0
    actors = Actors()
    pool = ModelPool(find_models([str(folder)]), max_loaded=3, max_bytes=int(size * 2.5), make_actor=actors)
    async with running(pool):
        with trio.fail_after(20):
            for name in ("alpha", "beta", "gamma"):  # two fit the bytes; the third unloads alpha
                async with pool.use(name) as engine:
                    assert await answer(engine) == SCRIPTS[name]
        assert {s.name: s.state for s in pool.status()} == {"alpha": "unloaded", "beta": "loaded",
                                                            "gamma": "loaded"}


async def test_an_idle_host_hands_mlx_s_buffer_cache_back_once(folder, monkeypatch):
    from trio_mlx.actor import _host

    cleared: list[float] = []  # one entry per release
    monkeypatch.setattr(_host, "_clear_cache", lambda: cleared.append(1.0))
    pool = ModelPool(find_models([str(folder)]), make_actor=Actors(),
                     engine_options={"idle_release": 0.05})
    async with running(pool):
        with trio.fail_after(20):
            async with pool.use("alpha") as engine:
                assert await answer(engine) == SCRIPTS["alpha"]
            while not cleared:  # noqa: ASYNC110
                await trio.sleep(0.01)
            await trio.sleep(0.2)
        assert len(cleared) == 1  # once per idle spell, not every wake


async def test_a_request_that_leaves_during_the_load_does_not_cancel_it(folder):
    actors = Actors(alpha={"load_seconds": 0.4})
    pool = ModelPool(find_models([str(folder)]), make_actor=actors)
    async with running(pool):
        results: list[list[int]] = []

        with trio.fail_after(20):
            async with trio.open_nursery() as inner:
                with trio.move_on_after(0.1):  # the first asker (whose request began the load) leaves
                    await ask(pool, results)
                inner.start_soon(ask, pool, results)
        assert results == [SCRIPTS["alpha"]] and actors.loads("alpha") == 1


async def test_a_load_past_its_time_bound_fails_its_requests_and_ends_before_another(folder):
    actors = Actors(alpha={"load_seconds": 1.5})  # "hangs": longer than the bound
    pool = ModelPool(find_models([str(folder)]), max_loaded=1, make_actor=actors, load_timeout=0.3, retry_after=0.5)
    async with running(pool):
        failed: list[tuple[float, ModelLoadTimeoutError]] = []

        async def ask() -> None:
            with pytest.raises(ModelLoadTimeoutError) as caught:
                async with pool.use("alpha"):
                    pass
            failed.append((trio.current_time(), caught.value))

        with trio.fail_after(20):
            t0 = trio.current_time()
            async with trio.open_nursery() as inner:
                inner.start_soon(ask)
                await trio.sleep(0.1)
                inner.start_soon(ask)  # one waiting for the same load fails with it
            assert len(failed) == 2 and all(t - t0 < 1.2 for t, _ in failed)  # at the bound, not the load's end
            assert "did not load within 0.3 s (startup_timeout)" in str(failed[0][1])
            assert failed[0][1].retry_after == 0.5
            # its work still ends (the GPU thread is in the weights' load): a request now fails at
            # once, and no second load starts beside the first
            assert {s.name: s.state for s in pool.status()}["alpha"] == "unloading"
            await ask()
            assert actors.loads("alpha") == 1
            while {s.name: s.state for s in pool.status()}["alpha"] != "unloaded":  # noqa: ASYNC110
                await trio.sleep(0.02)
            assert [a for n, a in actors.made if n == "alpha"][0].stopped  # freed on the host
            await ask()  # and for retry_after after its end, a request fails without a load
            assert actors.loads("alpha") == 1
            await trio.sleep(0.5)
            actors.options["alpha"] = {}  # the next load is quick: the model serves again
            async with pool.use("alpha") as engine:
                assert await answer(engine) == SCRIPTS["alpha"]
        assert actors.loads("alpha") == 2
        with pytest.raises(ValueError, match="load_timeout"):
            ModelPool({"a": "a"}, load_timeout=0)


async def test_a_model_whose_load_failed_is_not_loaded_again_for_retry_after(folder):
    """A client that retries a broken model at once does not hold the GPU thread in loads."""
    actors = Actors(beta={"load_seconds": -1})  # FakeActor sleeps: a negative time raises
    pool = ModelPool(find_models([str(folder)]), max_loaded=2, make_actor=actors, retry_after=0.5)
    async with running(pool):
        with trio.fail_after(20):
            for _ in range(20):
                with pytest.raises(ModelLoadError, match="ValueError") as caught:
                    async with pool.use("beta"):
                        pass
            assert actors.loads("beta") == 1 and not isinstance(caught.value, ModelLoadTimeoutError)
            await trio.sleep(0.5)
            with pytest.raises(ModelLoadError):
                async with pool.use("beta"):
                    pass
            assert actors.loads("beta") == 2  # tried again once retry_after passed


async def test_names_the_pool_does_not_list_load_nothing_and_reach_no_file(folder):
    """Hostile names: only the listed models are ever loaded; a name is a key, never a path."""
    actors = Actors()
    (folder / "notes" / "config.json").write_text("{}")  # a model folder the pool was not given
    pool = ModelPool(find_models([str(folder / "alpha")]), make_actor=actors)
    async with running(pool):
        with trio.fail_after(20):
            for name in ("beta", "../beta", str(folder / "beta"), "notes", "../notes", "alpha/../beta",
                         "/etc", "", "alpha/", "ALPHA", "alpha\x00"):
                with pytest.raises(trio_mlx.InvalidRequestError, match="does not exist") as caught:
                    async with pool.use(name):
                        pass
                assert caught.value.code == "model_not_found"
        assert actors.made == [] and pool.names == ("alpha",)
        assert [s.state for s in pool.status()] == ["unloaded"]


async def test_unload_takes_an_idle_model_only(folder):
    actors = Actors(alpha={"load_seconds": 0.4})
    pool = ModelPool(find_models([str(folder)]), make_actor=actors)
    async with running(pool):
        with trio.fail_after(20):
            assert await pool.unload("alpha") is False  # not loaded
            async with trio.open_nursery() as inner:
                async def ask() -> None:
                    async with pool.use("alpha") as engine:
                        await answer(engine)

                inner.start_soon(ask)
                await trio.sleep(0.1)
                with pytest.raises(ModelBusyError, match="'alpha' is loading"):
                    await pool.unload("alpha")
            async with pool.use("alpha"):  # admitted (pinned): not idle
                with pytest.raises(ModelBusyError, match="serving requests"):
                    await pool.unload("alpha")
            assert await pool.unload("alpha") is True
            assert [a for n, a in actors.made if n == "alpha"][0].stopped
            with pytest.raises(trio_mlx.InvalidRequestError, match="does not exist"):
                await pool.unload("../alpha")
        assert {s.name: s.state for s in pool.status()}["alpha"] == "unloaded"
