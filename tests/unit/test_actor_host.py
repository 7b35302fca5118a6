"""`ActorHost` (`actor/_host.py`), the one GPU thread of several engines, over `FakeActor`: each
engine's actor runs there in turns, an actor that dies takes only its own engine's requests down
(and its engine starts a new one there), and an engine that closes or is cancelled has its actor
stopped on the host."""

from __future__ import annotations

import threading

import trio

import trio_mlx
from trio_mlx.actor import FakeActor
from trio_mlx.actor._host import ActorHost


async def answer(engine: trio_mlx.Engine, n: int = 5) -> tuple[list[int], trio_mlx.Finished]:
    ids: list[int] = []
    async with engine.generate("hi", max_tokens=n, ignore_eos=True) as events:
        async for ev in events:
            if isinstance(ev, trio_mlx.TextDelta):
                ids += ev.token_ids
            else:
                return ids, ev
    raise AssertionError("no Finished event")


class Made(list):
    """A factory of fake actors that keeps them, and the threads each started on."""

    def __init__(self, actor=FakeActor, **options):
        super().__init__()
        self.actor, self.options, self.threads = actor, options, set()

    def __call__(self, config, link):
        actor = self.actor(config, link, **self.options)
        self.append(actor)
        start = actor.start

        def started():
            self.threads.add(threading.get_ident())
            start()

        actor.start = started
        return actor


async def test_engines_on_one_host_share_its_one_thread_and_each_answers(tiny_model_fp32):
    made = Made(step_seconds=0.002)
    host = ActorHost(made)
    async with trio.open_nursery() as nursery:
        await nursery.start(host.run)
        with trio.fail_after(20):
            async with trio_mlx.open_engine(tiny_model_fp32, actor=host) as a, \
                    trio_mlx.open_engine(tiny_model_fp32, actor=host) as b:
                results: list[list[int]] = []

                async def ask(engine: trio_mlx.Engine) -> None:
                    results.append((await answer(engine, 20))[0])

                async with trio.open_nursery() as both:  # both decode at once, in turns
                    for engine in (a, b, a, b):
                        both.start_soon(ask, engine)
                assert len(results) == 4 and all(len(r) == 20 for r in results)
                assert a.info is not None and b.info is not None
                assert a.info.thread_id == b.info.thread_id == host.thread_id
                assert made.threads == {host.thread_id}
        assert len(made) == 2 and all(actor.stopped for actor in made)  # each engine's close stopped its actor
        nursery.cancel_scope.cancel()


class Dies(FakeActor):
    """Raises on its first turn with a command: the actor dies (the fake recovers no step)."""

    def turn(self, commands):
        if commands:
            raise RuntimeError("boom")
        return super().turn(commands)


async def test_an_actor_that_dies_fails_its_engine_s_requests_only(tiny_model_fp32):
    made: list[FakeActor] = []

    def make(config, link):  # the first actor (a's) dies; the others live
        made.append(actor := (FakeActor if made else Dies)(config, link, step_seconds=0.005))
        return actor

    host = ActorHost(make)
    async with trio.open_nursery() as nursery:
        await nursery.start(host.run)
        with trio.fail_after(20):
            async with trio_mlx.open_engine(tiny_model_fp32, actor=host, restart_backoff=0.01) as a, \
                    trio_mlx.open_engine(tiny_model_fp32, actor=host) as other:
                long = other.generate("hi", max_tokens=100, ignore_eos=True)
                async with long as events:  # in flight on the other actor across a's death
                    ids, fin = await answer(a)
                    assert fin.finish_reason == "error" and ids == []  # its actor died under it
                    got = [ev async for ev in events]
                assert got[-1].finish_reason == "length" and sum(len(ev.token_ids) for ev in got[:-1]) == 100
                with trio.fail_after(10):
                    while a.state != "ready":  # noqa: ASYNC110
                        await trio.sleep(0.01)
                ids, fin = await answer(a)  # a new actor, started on the host again
                assert fin.finish_reason == "length" and len(ids) == 5
                assert a.statistics().actor_restarts == 1
                assert (await answer(other))[1].finish_reason == "length"
                assert other.statistics().actor_restarts == 0
        assert [type(actor) for actor in made] == [Dies, FakeActor, FakeActor]
        nursery.cancel_scope.cancel()


async def test_a_cancelled_engine_s_actor_is_stopped_on_the_host(tiny_model_fp32):
    made = Made()
    host = ActorHost(made)
    async with trio.open_nursery() as nursery:
        await nursery.start(host.run)
        engine = trio_mlx.Engine(tiny_model_fp32, actor=host)
        with trio.fail_after(20):
            async with trio.open_nursery() as inner:
                await inner.start(engine.run)
                assert (await answer(engine))[1].finish_reason == "length"
                inner.cancel_scope.cancel()  # not a close: the engine's task is cancelled
        assert made[0].stopped and engine.state == "closed"
        nursery.cancel_scope.cancel()
    assert not host._hosted  # the host thread holds nothing after its end


class BuildsThenDies(FakeActor):
    """Says its graph is built each step, as the real actor's forward does (so its link holds
    each decode report until the next build), and dies on its seventh step's turn, before
    building it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reported = 0  # tokens its reports held

    def turn(self, commands):
        if self.steps == 6:
            raise RuntimeError("boom")
        return super().turn(commands)

    def _step(self, new):
        self._link.built()
        report = super()._step(new)
        self.reported += len(report.tokens)
        return report


async def test_a_hosted_actor_that_dies_before_its_next_graph_hands_its_last_tokens_over(tiny_model_fp32):
    made = Made(BuildsThenDies, step_seconds=0.002)
    host = ActorHost(made)
    async with trio.open_nursery() as nursery:
        await nursery.start(host.run)
        with trio.fail_after(20):
            async with trio_mlx.open_engine(tiny_model_fp32, actor=host, restart_limit=0) as engine:
                ids, fin = await answer(engine, 100)
        assert fin.finish_reason == "error"
        assert len(ids) == made[0].reported == 6  # the held sixth too: the host released its link
        nursery.cancel_scope.cancel()
