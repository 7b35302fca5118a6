"""The engine over `FakeActor`: its registry, aborts and text handling, in milliseconds.

The fake speaks the actor's protocol with a counting "model" whose output is
known in advance (`FakeActor.continuation`), so these tests check exact tokens
and texts without MLX doing any work (only the tokenizer is loaded).
"""

from __future__ import annotations

import functools

import pytest
import trio

import trio_mlx
from trio_mlx.actor import FakeActor


def fake(**options):
    return functools.partial(FakeActor, **options)


async def collect(events) -> tuple[list[int], str, trio_mlx.Finished]:
    ids, text = [], ""
    async for ev in events:
        if isinstance(ev, trio_mlx.TextDelta):
            ids += ev.token_ids
            text += ev.text
        else:
            return ids, text, ev
    raise AssertionError("no Finished event")


async def test_tokens_are_the_fake_models_and_usage_counts_them(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32, actor=FakeActor) as engine:
        assert engine.info is not None and engine.info.device == "fake"
        async with engine.generate("The quick brown fox", max_tokens=7, ignore_eos=True) as events:
            prompt = list(events.prompt_tokens)
            ids, text, fin = await collect(events)
    assert ids == FakeActor.continuation(prompt, 7)
    assert text == engine.tokenizer.decode(ids)
    assert fin.finish_reason == "length" and fin.usage.completion_tokens == 7
    assert fin.usage.prompt_tokens == len(prompt)


async def test_a_stop_string_ends_the_text_before_it(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32, actor=FakeActor) as engine:
        async with engine.generate("abc", max_tokens=40, ignore_eos=True) as events:
            prompt = list(events.prompt_tokens)
        full = engine.tokenizer.decode(FakeActor.continuation(prompt, 40))
        stop = full[10:13]
        assert stop and full.index(stop) == 10
        async with engine.generate("abc", max_tokens=40, ignore_eos=True, stop=[stop]) as events:
            _, text, fin = await collect(events)
    assert fin.finish_reason == "stop" and fin.stop == stop
    assert text == full[:10]


async def test_leaving_a_stream_aborts_its_sequence_before_the_next_step(tiny_model_fp32):
    actors: list[FakeActor] = []

    def factory(config, link):
        actors.append(FakeActor(config, link, step_seconds=0.01))
        return actors[-1]

    async with trio_mlx.open_engine(tiny_model_fp32, actor=factory) as engine:
        with trio.fail_after(10):
            async with engine.generate("long", max_tokens=2000, ignore_eos=True) as events:
                async for _ in events:
                    break  # the reader leaves after its first event
            while engine.statistics().active:  # noqa: ASYNC110
                await trio.sleep(0.005)
        stats = engine.statistics()
    assert stats.aborts == 1 and stats.generated_tokens < 100
    assert actors[0].steps < 100  # it did not decode the 2,000 tokens nobody reads


@pytest.mark.parametrize("n", [1, 8])
async def test_concurrent_requests_each_get_their_own_continuation(tiny_model_fp32, n):
    results: dict[int, tuple[list[int], list[int]]] = {}
    async with trio_mlx.open_engine(tiny_model_fp32, actor=FakeActor) as engine:

        async def one(i: int) -> None:
            async with engine.generate(f"request number {i}", max_tokens=5 + i, ignore_eos=True) as events:
                prompt = list(events.prompt_tokens)
                ids, _, _ = await collect(events)
            results[i] = (prompt, ids)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)
    for i, (prompt, ids) in results.items():
        assert ids == FakeActor.continuation(prompt, 5 + i)


async def test_several_tokens_of_a_request_in_one_step_each_meet_the_finish_rule(tiny_model_fp32):
    """A step that brings a request several tokens (speculative decoding keeps drafts): the
    stream takes them in order, max_tokens ends it at its exact count, and its usage and the
    engine's statistics count the drafted and kept tokens."""
    async with trio_mlx.open_engine(tiny_model_fp32, actor=fake(tokens_per_step=4)) as engine:
        async with engine.generate("The quick brown fox", max_tokens=10, ignore_eos=True) as events:
            prompt = list(events.prompt_tokens)
            ids, text, fin = await collect(events)
        stats = engine.statistics()
    assert ids == FakeActor.continuation(prompt, 10) and text == engine.tokenizer.decode(ids)
    assert fin.finish_reason == "length" and fin.usage.completion_tokens == 10
    # steps of 4, 4, 2 tokens: 3 drafted each, 3 + 3 + 1 kept
    assert (fin.usage.draft_tokens, fin.usage.accepted_draft_tokens) == (9, 7)
    assert (stats.draft_tokens, stats.accepted_draft_tokens) == (9, 7)


async def test_a_stop_string_inside_one_steps_tokens_ends_the_text_before_it(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32, actor=fake(tokens_per_step=6)) as engine:
        async with engine.generate("abc", max_tokens=40, ignore_eos=True) as events:
            prompt = list(events.prompt_tokens)
        ids = FakeActor.continuation(prompt, 40)
        full = engine.tokenizer.decode(ids)
        stop = full[10:13]
        assert stop and full.index(stop) == 10
        async with engine.generate("abc", max_tokens=40, ignore_eos=True, stop=[stop]) as events:
            got, text, fin = await collect(events)
        async with engine.generate("abc", max_tokens=40, stop_token_ids=[ids[8]]) as events:
            stopped, _, by_token = await collect(events)
    assert fin.finish_reason == "stop" and fin.stop == stop and text == full[:10]
    assert len(got) < 40 and fin.usage.completion_tokens == len(got)
    assert by_token.finish_reason == "stop" and by_token.stop == ids[8] and by_token.usage.completion_tokens == 9
    assert stopped == ids[:9]


async def test_openai_usage_and_metrics_report_drafted_and_kept_tokens(tiny_model_fp32):
    """A completion's usage says, as OpenAI reports predicted outputs, how many drafted tokens
    its completion kept and how many it did not; /metrics counts both over the server's life.
    A request without drafts has no completion_tokens_details."""
    from app_server import engine_factory, serve

    async with serve(tiny_model_fp32, factory=engine_factory(actor=fake(tokens_per_step=4))) as server, \
            server.client() as client:
        body = {"prompt": "abc", "max_tokens": 10, "ignore_eos": True}
        r = await client.post("/v1/completions", json=body)
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == 10
        assert usage["completion_tokens_details"] == {"accepted_prediction_tokens": 7, "rejected_prediction_tokens": 2}
        metrics = (await client.get("/metrics")).text
    assert "trio_mlx_draft_tokens_total 9.0" in metrics
    assert "trio_mlx_accepted_draft_tokens_total 7.0" in metrics
    async with serve(tiny_model_fp32, factory=engine_factory(actor=FakeActor)) as server, server.client() as client:
        r = await client.post("/v1/completions", json=body)
        assert "completion_tokens_details" not in r.json()["usage"]
