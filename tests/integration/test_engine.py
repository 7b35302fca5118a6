"""The engine and the GPU actor, driven through the public channel API on tiny CPU models."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import pytest
import trio
import trio.testing

import trio_mlx
from trio_mlx import Finished, TextDelta
from trio_mlx.engine._options import MAX_STOP_CHARS


async def collect(stream: trio_mlx.RequestStream) -> tuple[list[int], str, Finished]:
    ids: list[int] = []
    text: list[str] = []
    async for ev in stream:
        if isinstance(ev, TextDelta):
            ids.extend(ev.token_ids)
            text.append(ev.text)
        else:
            return ids, "".join(text), ev
    raise AssertionError("stream ended without a Finished event")


async def run(engine: trio_mlx.Engine, prompt, **opts) -> tuple[list[int], str, Finished]:
    async with engine.generate(prompt, **opts) as events:
        return await collect(events)


async def until(pred: Callable[[], bool], seconds: float = 10.0) -> None:
    """Poll `pred` (engine statistics are snapshots, not events) for up to `seconds`."""
    with trio.fail_after(seconds):
        while not pred():  # noqa: ASYNC110
            await trio.sleep(0.001)


async def settled(engine: trio_mlx.Engine) -> None:
    """Until the statistics show what the last batch that ran dry left behind: the actor stores
    such a batch's finished rows in the prompt cache after the report of their last tokens, and
    before it applies any command, so the reports of one more request (too short to store)
    carry the figures after it."""
    await run(engine, "settle", max_tokens=1, temperature=0.0)


PROMPTS = [
    "The quick brown fox",
    "Hello world, what is the capital of France?",
    "0123456789",
    "a b c d e f g h i j k l m n o p",
]


def reference_greedy(model_path, prompt_ids: list[int], n: int) -> list[int]:
    """mlx_lm's own single-sequence generation, the ground truth."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(model_path)
    out = []
    for tok, _ in generate_step(mx.array(prompt_ids), model, max_tokens=n):
        out.append(int(tok))
    return out


async def test_solo_greedy_matches_mlx_lm_generate(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=8) as engine:
        for prompt in PROMPTS:
            ids = engine.encode_prompt("text", prompt)
            expected = reference_greedy(tiny_model_fp32, ids, 24)
            got, _, fin = await run(engine, prompt, max_tokens=24, temperature=0, ignore_eos=True)
            assert got == expected, prompt
            assert fin.finish_reason == "length"
            assert fin.usage.prompt_tokens == len(ids)
            assert fin.usage.completion_tokens == 24


async def test_greedy_tokens_identical_alone_and_in_a_batch_of_16(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=16) as engine:
        prompts = [f"{PROMPTS[i % 4]} {i}" * (1 + i % 3) for i in range(16)]
        alone = [(await run(engine, p, max_tokens=20, temperature=0, ignore_eos=True))[0] for p in prompts]
        together: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            together[i] = (await run(engine, prompts[i], max_tokens=20, temperature=0, ignore_eos=True))[0]

        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(one, i)
        assert [together[i] for i in range(16)] == alone
        assert engine.statistics().mean_step_seconds > 0


async def test_64_concurrent_streams_finish_with_right_lengths_and_usage(tiny_model_bf16):
    async with trio_mlx.open_engine(tiny_model_bf16, max_batch=64) as engine:
        results: dict[int, tuple[list[int], str, Finished]] = {}

        async def one(i: int) -> None:
            results[i] = await run(engine, f"request {i}: " + "x" * i, max_tokens=8 + i % 9, ignore_eos=True, temperature=0.8)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(64):
                    nursery.start_soon(one, i)
        for i in range(64):
            ids, _, fin = results[i]
            assert fin.finish_reason == "length"
            assert len(ids) == fin.usage.completion_tokens == 8 + i % 9
            assert fin.usage.prompt_tokens == len(engine.encode_prompt("text", f"request {i}: " + "x" * i))
        stats = engine.statistics()
        assert stats.requests_finished == stats.requests_submitted == 64
        assert stats.generated_tokens == sum(8 + i % 9 for i in range(64))
        assert (stats.active, stats.queued, stats.prefilling, stats.decoding) == (0, 0, 0, 0)


async def test_eos_ends_a_sequence_unless_ignored(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32) as engine:
        ids, _, _ = await run(engine, "Hello", max_tokens=6, temperature=0, ignore_eos=True)
        eos = ids[2]  # pretend the third greedy token is an end-of-sequence token
        got, text, fin = await run(engine, "Hello", max_tokens=6, temperature=0, stop_token_ids=[eos])
        assert got == ids[: ids.index(eos) + 1]
        assert fin.finish_reason == "stop" and fin.stop == eos
        assert fin.usage.completion_tokens == len(got)


class ActorClock:
    """A fault hook that only watches: the actor iteration each removal happened in."""

    def __init__(self) -> None:
        self.loops = 0
        self.removed_at: list[int] = []

    def __call__(self, stage: str) -> None:
        if stage == "loop":
            self.loops += 1
        elif stage == "removed":
            self.removed_at.append(self.loops)


async def test_abort_while_decoding_frees_the_slot_and_admits_a_waiter(tiny_model_fp32):
    clock = ActorClock()
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=1, prefill_batch=1, fault_hook=clock) as engine:
        waiter_tokens: list[int] = []

        async def waiter() -> None:
            ids, _, fin = await run(engine, "second", max_tokens=5, ignore_eos=True, temperature=0)
            waiter_tokens.extend(ids)
            assert fin.finish_reason == "length"

        async with trio.open_nursery() as nursery:
            async with engine.generate("first", max_tokens=1000, ignore_eos=True, temperature=0) as events:
                async for ev in events:
                    assert isinstance(ev, TextDelta)
                    break  # decoding now
                nursery.start_soon(waiter)
                await until(lambda: engine.statistics().active == 2)  # one decoding, one queued
            # the link hands the abort over once the loop has run its current tasks: then the
            # actor iteration under way is the one it reached the actor in
            await trio.testing.wait_all_tasks_blocked()
            aborted_during = clock.loops
            await until(lambda: bool(clock.removed_at))
            # removed before the step after the one in progress: the slot is free by the next step
            assert clock.removed_at[0] <= aborted_during + 1
            assert engine.statistics().aborts_by_stage == {"decode": 1}
        assert len(waiter_tokens) == 5


async def test_abort_while_queued_never_runs_the_sequence(tiny_model_fp32):
    clock = ActorClock()
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=1, prefill_batch=1, fault_hook=clock) as engine:
        async with engine.generate("busy", max_tokens=400, ignore_eos=True, temperature=0) as busy:
            async for _ in busy:
                break
            queued = engine.generate("queued", max_tokens=10, ignore_eos=True)
            async with queued:
                await until(lambda: engine.statistics().active == 2)
                assert queued.stage == "queued"
            await trio.testing.wait_all_tasks_blocked()  # the abort handed over (as above)
            aborted_during = clock.loops
            await until(lambda: bool(clock.removed_at))
            assert clock.removed_at[0] <= aborted_during + 1
            await until(lambda: engine.statistics().active == 1)
            stats = engine.statistics()
            assert stats.aborts_by_stage == {"queued": 1}
            assert stats.queued == 0
            assert queued.completion_tokens == 0


@pytest.mark.parametrize("staggered", [False, True])
async def test_max_batch_caps_the_decoding_batch_whatever_the_prefill_batch(tiny_model_fp32, staggered):
    # BatchGenerator widens its batch to prefill_batch_size (8 by default); the engine clamps it.
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=2) as engine:
        assert engine.tuning.prefill_batch == 2
        widest = 0

        async def watch() -> None:
            nonlocal widest
            while True:
                widest = max(widest, engine.statistics().decoding)
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            for i, p in enumerate(PROMPTS[:3]):
                nursery.start_soon(functools.partial(run, engine, p, max_tokens=40, ignore_eos=True))
                if staggered and i == 0:
                    await until(lambda: engine.statistics().decoding == 1)
            # The third waits while two decode. Arriving while the second prefills beside one
            # decoding row, it joins the prompt batch (mlx_lm counts free rows against the decoding
            # batch alone) and waits there, prefilled, not queued.
            def third_waits() -> bool:
                s = engine.statistics()
                return s.decoding == 2 and s.queued + s.prefilling == 1

            await until(third_waits)
            await until(lambda: engine.statistics().requests_finished == 3, seconds=30)
            nursery.cancel_scope.cancel()
        assert widest == 2


async def test_abort_while_prefilling_frees_the_slot(tiny_model_fp32):
    # A small prefill step makes a long prompt take many steps to prefill.
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=2, prefill_batch=1, prefill_step=4) as engine:
        long_prompt = [5 + i % 200 for i in range(400)]
        stream = engine.generate(long_prompt, max_tokens=4, ignore_eos=True)
        async with stream:
            await until(lambda: stream.stage == "prefill")
        await until(lambda: engine.statistics().active == 0, seconds=5)
        stats = engine.statistics()
        assert stats.aborts_by_stage == {"prefill": 1}
        # the engine keeps serving
        ids, _, fin = await run(engine, "after", max_tokens=3, ignore_eos=True)
        assert len(ids) == 3 and fin.finish_reason == "length"


async def test_cancel_scope_and_consumer_exception_abort(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32) as engine:
        with trio.move_on_after(0.05):
            await run(engine, "never ends", max_tokens=900, ignore_eos=True)
        with pytest.raises(ZeroDivisionError):
            async with engine.generate("boom", max_tokens=900, ignore_eos=True) as events:
                async for _ in events:
                    1 / 0  # noqa: B018
        await until(lambda: engine.statistics().active == 0)
        assert engine.statistics().aborts == 2


async def test_seeded_sampling_is_reproducible_under_concurrency(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=16) as engine:
        opts = dict(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
        alone, _, _ = await run(engine, "The quick brown fox", **opts)
        crowd: dict[int, list[int]] = {}

        async def other(i: int) -> None:
            crowd[i] = (await run(engine, f"noise {i}", max_tokens=30, temperature=1.0, seed=i if i % 2 else None, ignore_eos=True))[0]

        async def mine() -> None:
            crowd[-1] = (await run(engine, "The quick brown fox", **opts))[0]

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(other, i)
            await trio.sleep(0.01)  # join a batch that is already running
            nursery.start_soon(mine)
        assert crowd[-1] == alone
        other_seed, _, _ = await run(engine, "The quick brown fox", **{**opts, "seed": 99})
        assert other_seed != alone


async def test_stop_strings_match_across_token_boundaries(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32) as engine:
        ids, full, _ = await run(engine, "Hello world", max_tokens=30, temperature=0, ignore_eos=True)
        # the text each token adds; a stop string made of the last character of
        # one token and the first of the next spans a token boundary
        texts = [engine.tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
        adds = [texts[0]] + [texts[i][len(texts[i - 1]) :] for i in range(1, len(texts))]
        i = next(i for i in range(2, len(adds) - 1) if adds[i].strip() and adds[i + 1].strip())
        stop = adds[i][-1] + adds[i + 1][0]
        got_ids, text, fin = await run(engine, "Hello world", max_tokens=30, temperature=0, ignore_eos=True, stop=["zzz-never", stop])
        assert fin.finish_reason == "stop" and fin.stop == stop
        assert text == full[: full.index(stop)]
        assert stop not in text
        assert got_ids == ids[: len(got_ids)] and len(got_ids) < len(ids)
        await until(lambda: engine.statistics().active == 0)


async def test_logprobs_and_top_logprobs(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32) as engine:
        async with engine.generate("Hello", max_tokens=6, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3) as events:
            ids, logprobs = [], []
            async for ev in events:
                if isinstance(ev, TextDelta):
                    assert ev.logprobs is not None  # each goes out with its token's text
                    ids += ev.token_ids
                    logprobs += ev.logprobs
            lps = list(zip(ids, logprobs, strict=True))
        assert len(lps) == 6
        for tid, lp in lps:
            assert lp.token_id == tid and lp.logprob <= 0.0
            assert len(lp.top) == 3
            values = [v for _, _, v in lp.top]
            assert values == sorted(values, reverse=True)
            assert lp.top[0][0] == tid  # greedy picks the most likely token
            assert lp.top[0][2] == pytest.approx(lp.logprob, abs=1e-5)
            # each alternative's own bytes, in top's order; its text is them decoded, or `bytes:`
            assert len(lp.top_raw) == 3 and lp.top_raw[0] == lp.raw
            for (_, text, _), raw in zip(lp.top, lp.top_raw, strict=True):
                assert text.startswith("bytes:") or text.encode() == raw
        plain, _, _ = await run(engine, "Hello", max_tokens=6, temperature=0, ignore_eos=True)
        assert plain == [t for t, _ in lps]


async def test_logit_bias_and_penalties_steer_inside_the_batch(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32) as engine:
        forced = 42
        ids, _, _ = await run(engine, "Hello", max_tokens=5, temperature=0, ignore_eos=True, logit_bias={forced: 100})
        assert ids == [forced] * 5
        # a frequency penalty forbids repeating the forced token once it is generated
        ids, _, _ = await run(
            engine, "Hello", max_tokens=4, temperature=0, ignore_eos=True, logit_bias={forced: 5.0}, frequency_penalty=2.0, presence_penalty=2.0
        )
        base, _, _ = await run(engine, "Hello", max_tokens=4, temperature=0, ignore_eos=True, logit_bias={forced: 5.0})
        assert ids != base or base.count(forced) <= 1


async def test_invalid_arguments_raise_before_reaching_the_actor(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32) as engine:
        ctx = engine.context_length
        bad = [
            dict(prompt=""),
            dict(prompt=[]),
            dict(prompt="hi", max_tokens=0),
            dict(prompt="hi", max_tokens=ctx),
            dict(prompt="hi", temperature=-1),
            dict(prompt="hi", top_p=0),
            dict(prompt="hi", top_logprobs=50),
            dict(prompt="hi", logit_bias={"x": 1}),
            dict(prompt="hi", logit_bias={10**9: 1}),
            dict(prompt="hi", logit_bias={"1_0": 1}),  # int() reads these as 10; a token id is ASCII digits
            dict(prompt="hi", logit_bias={" 10\n": 1}),
            dict(prompt="hi", logit_bias={"\u0661\u0660": 1}),  # Arabic-Indic digits
            dict(prompt="hi", logit_bias={"+10": 1}),
            dict(prompt="hi", logit_bias={"10": 100, "010": -100}),  # one token, two biases
            dict(prompt="hi", logit_bias={True: 1}),
            dict(prompt="hi", stop=["x" * (MAX_STOP_CHARS + 1)]),
            dict(prompt=[1, 2, 10**9]),
            dict(prompt="hi", stop=[1, 2]),
            dict(prompt="hi", presence_penalty=5),
        ]
        for case in bad:
            prompt = case.pop("prompt")
            with pytest.raises(trio_mlx.InvalidRequestError):
                async with engine.generate(prompt, **case):
                    pass
        with pytest.raises(trio_mlx.ContextLengthExceededError) as info:
            async with engine.generate("hi " * ctx, max_tokens=1):
                pass
        assert info.value.code == "context_length_exceeded"
        with pytest.raises(trio_mlx.InvalidRequestError):
            async with engine.chat([]):
                pass
        assert engine.statistics().requests_submitted == 0


async def test_queue_full_is_rejected_without_reaching_the_actor(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=1, prefill_batch=1, max_queue=1) as engine:
        async with engine.generate("a", max_tokens=500, ignore_eos=True) as first:
            async for _ in first:
                break
            async with engine.generate("b", max_tokens=5, ignore_eos=True):
                with pytest.raises(trio_mlx.QueueFullError) as info:
                    async with engine.generate("c", max_tokens=5):
                        pass
                assert info.value.retry_after > 0
        stats = engine.statistics()
        assert stats.requests_submitted == 2 and stats.requests_rejected == 1


async def test_chat_uses_the_template_and_list_parts(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32) as engine:
        messages = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]}]
        expected = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hello world"}], tokenize=False, add_generation_prompt=True
        )
        async with engine.chat(messages, max_tokens=3, ignore_eos=True) as events:
            assert engine.tokenizer.decode(events.prompt_tokens) == expected
            _, _, fin = await collect(events)
        assert fin.usage.completion_tokens == 3


async def test_long_prompts_are_tokenized_off_the_event_loop(tiny_model_fp32, monkeypatch):
    async with trio_mlx.open_engine(tiny_model_fp32) as engine:
        threads: list[int] = []
        original = engine.encode_prompt

        def spy(*args, **kwargs):
            threads.append(threading.get_ident())
            return original(*args, **kwargs)

        monkeypatch.setattr(engine, "encode_prompt", spy)
        # the default bound: a prompt of a few hundred tokens (1,100 characters) goes to a thread
        await run(engine, "word " * 219 + "end", max_tokens=2, ignore_eos=True)
        await run(engine, "short", max_tokens=2, ignore_eos=True)
        main = threading.get_ident()
        assert threads[0] != main and threads[1] == main


async def test_every_mlx_call_happens_on_the_actor_thread(tiny_model_fp32, monkeypatch):
    from mlx_lm.generate import BatchGenerator

    from trio_mlx import models

    seen: dict[str, set[int]] = {}

    def spy(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            seen.setdefault(name, set()).add(threading.get_ident())
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for name in ("__init__", "insert", "next", "remove", "close"):
        spy(BatchGenerator, name)
    spy(models, "load_model")
    async with trio_mlx.open_engine(tiny_model_fp32) as engine:
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(functools.partial(run, engine, f"p{i}", max_tokens=6))
        async with engine.generate("aborted", max_tokens=500, ignore_eos=True) as events:
            async for _ in events:
                break
        await until(lambda: engine.statistics().active == 0)
        actor_thread = engine.info.thread_id
    assert set(seen) == {"__init__", "insert", "next", "remove", "close", "load_model"}, sorted(seen)
    threads = set().union(*seen.values())
    assert threads == {actor_thread}
    assert actor_thread != threading.get_ident()


async def test_load_failure_raises_promptly(tmp_path, tiny_model_fp32):
    with trio.fail_after(10):
        with pytest.raises(trio_mlx.ModelLoadError):
            async with trio_mlx.open_engine(tmp_path / "does-not-exist"):
                pass
        broken = tmp_path / "broken"
        broken.mkdir()
        for f in tiny_model_fp32.iterdir():
            if f.suffix != ".safetensors":
                (broken / f.name).write_bytes(f.read_bytes())
        with pytest.raises(trio_mlx.ModelLoadError, match="could not load"):
            async with trio_mlx.open_engine(broken):
                pass


async def fault_during_decode(engine: trio_mlx.Engine, victims: int, armed: threading.Event) -> list[Finished]:
    """Start `victims` long requests, arm the fault once all are decoding, and
    return their terminal events: every one must arrive within 1 s."""
    finishes: list[Finished] = []

    async def one(i: int) -> None:
        finishes.append((await run(engine, f"victim {i}", max_tokens=800, ignore_eos=True))[2])

    async with trio.open_nursery() as nursery:
        for i in range(victims):
            nursery.start_soon(one, i)
        await until(lambda: engine.statistics().decoding == victims)
        armed.set()
        await until(lambda: len(finishes) == victims, seconds=1)
    return finishes


async def test_a_failing_step_ends_every_waiter_and_the_engine_recovers(tiny_model_fp32):
    armed = threading.Event()

    def hook(stage: str) -> None:
        if stage == "step" and armed.is_set():
            armed.clear()
            raise RuntimeError("injected step fault")

    async with trio_mlx.open_engine(tiny_model_fp32, fault_hook=hook) as engine:
        finishes = await fault_during_decode(engine, 6, armed)
        assert all(f.finish_reason == "error" and "injected step fault" in (f.error or "") for f in finishes)
        assert engine.statistics().step_failures == 6
        ids, _, fin = await run(engine, "still alive", max_tokens=4, ignore_eos=True)
        assert len(ids) == 4 and fin.finish_reason == "length"


async def test_actor_death_breaks_the_engine_and_wakes_everyone(tiny_model_fp32):
    armed = threading.Event()

    def hook(stage: str) -> None:
        if stage == "loop" and armed.is_set():
            raise SystemError("injected actor crash")

    async with trio_mlx.open_engine(tiny_model_fp32, fault_hook=hook, restart_limit=0) as engine:
        finishes = await fault_during_decode(engine, 5, armed)
        assert [f.finish_reason for f in finishes] == ["error"] * 5
        assert engine.statistics().state == "broken"
        with pytest.raises(trio_mlx.EngineBrokenError):
            async with engine.generate("x"):
                pass


async def test_close_wakes_every_waiter_and_refuses_new_work(tiny_model_fp32):
    finishes: list[Finished] = []
    async with trio_mlx.open_engine(tiny_model_fp32) as engine:

        async def one(i: int) -> None:
            finishes.append((await run(engine, f"long {i}", max_tokens=900, ignore_eos=True))[2])

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
            await until(lambda: engine.statistics().decoding == 4)
            with trio.fail_after(5):
                await engine.aclose(drain_timeout=0.05)
    assert [f.finish_reason for f in finishes] == ["abort"] * 4
    assert engine.statistics().state == "closed"
    with pytest.raises(trio_mlx.EngineClosedError):
        async with engine.generate("x"):
            pass


async def test_drain_lets_in_flight_requests_finish(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32) as engine:
        result: list[Finished] = []

        async def one() -> None:
            result.append((await run(engine, "short job", max_tokens=20, ignore_eos=True))[2])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            await until(lambda: engine.statistics().decoding == 1)
            await engine.aclose(drain_timeout=30)
        assert result[0].finish_reason == "length" and result[0].usage.completion_tokens == 20


async def test_idle_actor_blocks_instead_of_spinning(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32) as engine:
        await run(engine, "warm", max_tokens=2)
        steps = engine.statistics().decode_steps
        import time

        cpu0 = time.process_time()
        await trio.sleep(0.5)
        cpu = time.process_time() - cpu0
        assert engine.statistics().decode_steps == steps
        assert cpu < 0.1, f"idle engine used {cpu:.3f}s CPU in 0.5s"


async def test_the_embedded_default_answers(embedded_model):
    async with trio_mlx.open_engine(embedded_model) as engine:
        async with engine.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=20, temperature=0) as events:
            _, text, fin = await collect(events)
    assert "Paris" in text
    assert fin.finish_reason in ("stop", "length")


async def test_the_queue_limit_counts_only_requests_beyond_free_slots(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=4, max_queue=1) as engine:
        streams = [engine.generate(f"s{i}", max_tokens=50, ignore_eos=True) for i in range(5)]
        for s in streams[:4]:  # four free slots: none of these is waiting for one
            await s.__aenter__()
        await streams[4].__aenter__()  # the one waiting request the queue allows
        with pytest.raises(trio_mlx.QueueFullError):
            async with engine.generate("over", max_tokens=5):
                pass
        for s in streams:
            s.close()
        assert engine.statistics().requests_rejected == 1


async def test_aborts_are_counted_by_cause(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32) as engine:
        async with engine.generate("a", max_tokens=500, ignore_eos=True) as events:
            async for _ in events:
                break
        async with engine.generate("b", max_tokens=500, ignore_eos=True) as events:
            async for _ in events:
                events.close("disconnect")
        ids, full, _ = await run(engine, "Hello", max_tokens=12, temperature=0, ignore_eos=True)
        stop = full[len(full) // 2 :][:2]
        if stop.strip():
            await run(engine, "Hello", max_tokens=12, temperature=0, ignore_eos=True, stop=stop)
        by_cause = engine.statistics().aborts_by_cause
        assert by_cause["cancelled"] == 1 and by_cause["disconnect"] == 1
        assert by_cause.get("stop_string", 0) == (1 if stop.strip() else 0)


async def test_cancelling_the_engine_task_closes_it_without_calling_it_a_death(tiny_model_fp32, caplog):
    engine = trio_mlx.Engine(tiny_model_fp32)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        await run(engine, "hi", max_tokens=2)
        nursery.cancel_scope.cancel()
    assert engine.statistics().state == "closed"
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


async def test_statistics_report_mlx_memory(tiny_model_fp32):
    async with trio_mlx.open_engine(tiny_model_fp32) as engine:
        await run(engine, "memory", max_tokens=4, ignore_eos=True)
        stats = engine.statistics()
        assert stats.peak_memory_bytes >= stats.active_memory_bytes > 0


async def test_close_from_another_task_while_a_token_is_being_handed_over(tiny_model_fp32):
    """The reader was already woken with a token when another task closed the stream (an HTTP
    disconnect): the reader must end quietly, not raise ClosedResourceError (found by the soak)."""
    from trio_mlx.actor import TokenOut

    gate = threading.Event()

    def hold(stage: str) -> None:  # keeps the actor from delivering anything itself
        if stage == "step":
            gate.wait(10)

    try:
        async with trio_mlx.open_engine(tiny_model_fp32, warmup=False, fault_hook=hold) as engine:
            async with engine.generate("x", max_tokens=50, ignore_eos=True) as stream:
                seen: list[object] = []

                async def reader() -> None:
                    async for ev in stream:
                        seen.append(ev)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(reader)
                    await trio.testing.wait_all_tasks_blocked()
                    assert stream._req is not None
                    stream._req.send.send_nowait(TokenOut(stream._req.rid, 7))  # the reader is woken...
                    stream.close("disconnect")  # ...and the stream closed before it runs
                assert all(isinstance(ev, TextDelta) for ev in seen)
            gate.set()
    finally:
        gate.set()


@pytest.mark.parametrize("actor", ["thread", "process"])
async def test_an_idle_actor_hands_mlx_buffer_cache_back(tiny_model_fp32, monkeypatch, actor):
    async with trio_mlx.open_engine(tiny_model_fp32, actor=actor, idle_release=0.3) as engine:
        await run(engine, "fill the cache " * 20, max_tokens=16, ignore_eos=True)
        assert engine.statistics().cache_memory_bytes > 0  # freed buffers kept for reuse
        with trio.fail_after(10):
            while engine.statistics().cache_memory_bytes:  # noqa: ASYNC110
                await trio.sleep(0.05)
        stats = engine.statistics()
        assert stats.active_memory_bytes > 0  # the model stays loaded
        # and it serves on
        ids, _, fin = await run(engine, "after", max_tokens=3, ignore_eos=True)
        assert len(ids) == 3 and fin.finish_reason == "length"


@pytest.mark.parametrize("actor", ["thread", "process"])
async def test_the_mlx_cache_limit_bounds_the_buffer_cache(tiny_model_fp32, monkeypatch, actor):
    # keep no freed buffers at all
    async with trio_mlx.open_engine(tiny_model_fp32, actor=actor, cache_limit_gb=0) as engine:
        ids, _, _ = await run(engine, "fill the cache " * 20, max_tokens=16, ignore_eos=True)
        assert len(ids) == 16
        stats = engine.statistics()
        assert stats.cache_memory_bytes == 0 and stats.active_memory_bytes > 0
    with pytest.raises(ValueError, match="cache_limit_gb must be >= 0"):
        async with trio_mlx.open_engine(tiny_model_fp32, actor=actor, cache_limit_gb=-1):
            pass


async def test_the_tools_module_loads_at_startup_not_with_the_first_request(tiny_model_fp32, monkeypatch):
    """Every request's options are checked through engine/_tools.py, which brings llguidance:
    imported in a worker thread at startup, not on the event loop by the first request
    (8-20 ms there on the CPU dev box)."""
    import sys

    import trio_mlx.engine

    name = "trio_mlx.engine._tools"
    monkeypatch.delitem(sys.modules, name, raising=False)  # restored after the test, as is
    monkeypatch.delattr(trio_mlx.engine, "_tools", raising=False)  # the package's attribute
    async with trio_mlx.open_engine(tiny_model_fp32) as engine:
        assert name in sys.modules  # before any request
        got, _, fin = await run(engine, [5, 6, 7], max_tokens=2, temperature=0)
        assert len(got) == 2 and fin.finish_reason == "length"


async def test_a_failed_step_is_logged_with_its_traceback_and_what_it_held_goes_first(tiny_model_fp32, caplog,
                                                                                        monkeypatch):
    """A step that raised: its traceback goes to the server's log once (its requests get the
    message alone), and the arrays its frames held are freed before `Actor._recover` resets the
    batch and hands MLX's buffer cache back (a step that ran out of memory held the most)."""
    import mlx.core as mx

    from trio_mlx.actor._actor import Actor

    armed = threading.Event()
    held_bytes = 64 * 1024 * 1024
    active: dict[str, int] = {}

    def hook(stage: str) -> None:
        if stage == "step" and armed.is_set():
            armed.clear()
            active["before"] = mx.get_active_memory()
            held = mx.zeros((held_bytes // 4,), dtype=mx.float32)  # what the failing step computed
            mx.eval(held)
            raise RuntimeError("injected step fault")

    recover = Actor._recover

    def timed_recover(self: Actor, exc: BaseException, failed: list[tuple[int, str]]) -> object:
        active["at_recover"] = mx.get_active_memory()
        return recover(self, exc, failed)

    monkeypatch.setattr(Actor, "_recover", timed_recover)
    with caplog.at_level("ERROR", logger="trio_mlx.actor"):
        async with trio_mlx.open_engine(tiny_model_fp32, fault_hook=hook) as engine:
            finishes = await fault_during_decode(engine, 3, armed)
            assert all(f.finish_reason == "error" for f in finishes)
    assert active["at_recover"] - active["before"] < held_bytes // 2, active
    logged = [r for r in caplog.records if "generation step failed" in r.getMessage()]
    assert len(logged) == 1
    assert "RuntimeError: injected step fault" in logged[0].getMessage() and "in hook" in logged[0].getMessage()
