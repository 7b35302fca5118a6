"""Admission into a decoding batch: new sequences enter together, within a bounded window.

`_admission.Admission` holds sequences that arrive while others decode until
a full group has gathered (`prefill_batch`, or beside a loaded batch up to 32
short prompts, as into an idle one) or the oldest has waited `admit_window`; an idle
batch admits at once, unless sequences just finished whose clients may be on
their way back. These tests drive it directly and through the engine on
tiny CPU models, reading the actor's step trace (the `step_trace` option) to see
which step inserted what.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from app_server import slow_steps

import trio_mlx
from trio_mlx.actor import SamplingParams, Submit
from trio_mlx.actor._admission import Admission as _Admission
from trio_mlx.actor._admission import group_bounds


def _sub(rid: int) -> Submit:
    return Submit(rid, (1, 2, 3), 4, SamplingParams(temperature=0.0), frozenset())


def _rids(subs: list[Submit]) -> list[int]:
    return [s.rid for s in subs]


def _sized(rid: int, tokens: int) -> Submit:
    return Submit(rid, (1,) * tokens, 4, SamplingParams(temperature=0.0), frozenset())


def test_short_prompts_gather_past_prefill_batch_within_rows_and_tokens():
    adm = _Admission(window=0.5, batch=2, rows=5, tokens=10)
    for rid in (1, 2, 3):
        adm.add(_sized(rid, 2), now=0.0)
    assert adm.group(decoding=4) == (2, True)  # fewer than `rows` decode: full at batch, as ever
    assert adm.group(decoding=5) == (3, False)
    assert adm.due(now=0.1, decoding=5, prefilling=False) == []  # 3 short ones wait for more
    for rid in (4, 5, 6):
        adm.add(_sized(rid, 2), now=0.1)
    assert _rids(adm.due(now=0.1, decoding=5, prefilling=False)) == [1, 2, 3, 4, 5]  # rows: full
    assert adm.due(now=0.2, decoding=5, prefilling=False) == []  # 6 alone waits for company...
    assert _rids(adm.due(now=0.6, decoding=5, prefilling=False)) == [6]  # ...or the window
    for rid in (7, 8, 9):
        adm.add(_sized(rid, 6), now=1.0)  # long: two hold 12 tokens, past the 10
    assert _rids(adm.due(now=1.0, decoding=5, prefilling=False)) == [7, 8]  # full at batch, as ever
    adm.drop(9)
    for rid, tokens in ((10, 2), (11, 2), (12, 2), (13, 5)):
        adm.add(_sized(rid, tokens), now=2.0)
    assert _rids(adm.due(now=2.0, decoding=5, prefilling=False)) == [10, 11, 12]  # 13 would pass 10
    assert adm.group(decoding=5) == (1, False)


def test_group_bounds_follow_the_settings():
    assert group_bounds(8, 2048, 64) == (32, 8192)  # the defaults: up to 32 short prompts, 8,192 tokens
    assert group_bounds(8, 2048, 32) == (16, 8192)  # at most half of max_batch...
    assert group_bounds(8, 2048, 8) == (8, 8192)  # ...but never fewer than prefill_batch
    assert group_bounds(64, 512, 256) == (64, 16384)  # a larger prefill_batch is its own bound


def test_an_idle_batch_takes_short_prompts_in_groups_of_rows_and_long_ones_by_batch():
    """No decoding row waits on an idle batch's prefill: a wave of short prompts enters in
    groups of `rows`, not `batch` (a step's cost hardly depends on its group's size); long
    ones still go by `batch`; and a wave's first arrivals wait for their company as before."""
    adm = _Admission(window=0.5, batch=2, rows=5, tokens=10)
    for rid in range(1, 8):
        adm.add(_sized(rid, 2), now=0.0)
    assert adm.group(decoding=0) == (5, True)
    assert adm.group(decoding=3) == (2, True)  # beside a few decoding rows: `batch`, as ever
    assert _rids(adm.due(now=0.0, decoding=0, prefilling=False)) == [1, 2, 3, 4, 5]
    assert _rids(adm.due(now=0.0, decoding=0, prefilling=False)) == [6, 7]  # idle: the rest at once
    for rid in (8, 9, 10):
        adm.add(_sized(rid, 6), now=1.0)
    assert _rids(adm.due(now=1.0, decoding=0, prefilling=False)) == [8, 9]  # long: full at batch
    adm.drop(10)
    adm.finished(now=2.0, count=4)  # a wave of four ended: its clients come back
    for rid in (11, 12, 13):
        adm.add(_sized(rid, 2), now=2.01)
    assert adm.due(now=2.01, decoding=0, prefilling=False) == []  # three wait for the fourth...
    adm.add(_sized(14, 2), now=2.02)
    assert _rids(adm.due(now=2.02, decoding=0, prefilling=False)) == [11, 12, 13, 14]  # ...and enter as one


def test_idle_batch_admits_a_group_at_once():
    adm = _Admission(window=10.0, batch=3)
    for rid in range(1, 6):
        adm.add(_sub(rid), now=0.0)
    assert _rids(adm.due(now=0.0, decoding=0, prefilling=False)) == [1, 2, 3]
    assert adm.due(now=0.0, decoding=0, prefilling=True) == []  # the group is prefilling
    assert _rids(adm.due(now=0.0, decoding=0, prefilling=False)) == [4, 5]


def test_decoding_batch_holds_until_window_or_a_full_prefill_group():
    adm = _Admission(window=0.5, batch=3)
    adm.add(_sub(1), now=0.0)
    adm.add(_sub(2), now=0.1)
    assert adm.due(now=0.2, decoding=3, prefilling=False) == []
    assert _rids(adm.due(now=0.5, decoding=3, prefilling=False)) == [1, 2]  # the oldest waited 0.5 s
    for rid in (3, 4):
        adm.add(_sub(rid), now=1.0)
    assert adm.due(now=1.0, decoding=3, prefilling=False) == []
    adm.add(_sub(5), now=1.0)  # three gathered: a full prefill group
    assert _rids(adm.due(now=1.0, decoding=3, prefilling=False)) == [3, 4, 5]


def test_the_window_shrinks_with_fewer_sequences_decoding():
    adm = _Admission(window=0.8, batch=4)
    adm.add(_sub(1), now=0.0)
    assert adm.due(now=0.19, decoding=1, prefilling=False) == []  # 1 of 4 decoding: 0.2 s
    assert _rids(adm.due(now=0.2, decoding=1, prefilling=False)) == [1]
    adm.add(_sub(2), now=1.0)
    assert adm.due(now=1.79, decoding=9, prefilling=False) == []  # a full batch or more: 0.8 s
    assert _rids(adm.due(now=1.8, decoding=4, prefilling=False)) == [2]


def test_one_group_at_a_time_and_none_while_one_prefills():
    adm = _Admission(window=0.5, batch=3)
    for rid in range(1, 8):
        adm.add(_sub(rid), now=0.0)
    assert _rids(adm.due(now=0.1, decoding=3, prefilling=False)) == [1, 2, 3]
    assert adm.due(now=0.1, decoding=3, prefilling=True) == []  # 1-3 still prefilling
    assert _rids(adm.due(now=0.2, decoding=3, prefilling=False)) == [4, 5, 6]
    assert adm.due(now=0.3, decoding=3, prefilling=False) == []  # one alone waits for company...
    assert adm.due(now=0.6, decoding=3, prefilling=True) == []  # ...never beside a prefill...
    assert _rids(adm.due(now=0.6, decoding=3, prefilling=False)) == [7]  # ...or the window


def test_arrivals_wait_for_the_clients_of_sequences_that_just_finished():
    adm = _Admission(window=0.8, batch=8)
    adm.finished(now=0.0, count=4)  # a wave of 4 ended; the batch is empty
    adm.add(_sub(1), now=0.01)
    assert adm.due(now=0.01, decoding=0, prefilling=False) == []  # 3 more on their way
    for rid in (2, 3):
        adm.add(_sub(rid), now=0.02)
    assert adm.due(now=0.02, decoding=0, prefilling=False) == []
    adm.add(_sub(4), now=0.03)
    assert _rids(adm.due(now=0.03, decoding=0, prefilling=False)) == [1, 2, 3, 4]  # all back: together
    # each admitted arrival matched one finish: the next lone arrival does not wait
    adm.add(_sub(5), now=0.04)
    assert _rids(adm.due(now=0.04, decoding=0, prefilling=False)) == [5]


def test_a_lone_client_never_waits_and_the_wait_is_bounded():
    adm = _Admission(window=0.8, batch=8)
    adm.finished(now=0.0, count=1)  # one stream ended, its client is back: nobody else to wait for
    adm.add(_sub(1), now=0.005)
    assert _rids(adm.due(now=0.005, decoding=0, prefilling=False)) == [1]
    adm.finished(now=1.0, count=2)  # two ended, one comes back: it waits 0.8 x 2/8 = 0.2 s at most
    adm.add(_sub(2), now=1.0)
    assert adm.due(now=1.19, decoding=0, prefilling=False) == []
    assert _rids(adm.due(now=1.21, decoding=0, prefilling=False)) == [2]
    adm.finished(now=2.0, count=8)  # finishes older than the window are forgotten
    adm.add(_sub(3), now=2.9)
    assert _rids(adm.due(now=2.9, decoding=0, prefilling=False)) == [3]
    adm.finished(now=3.0, count=1)  # more already waiting than just finished: no wait
    for rid in (4, 5):
        adm.add(_sub(rid), now=3.0)
    assert adm.hold(now=3.0) == 0.0
    assert _rids(adm.due(now=3.0, decoding=0, prefilling=False)) == [4, 5]
    adm.finished(now=4.0, count=4)  # 4 finished, 1 back: the actor may sleep until the wait ends
    adm.add(_sub(6), now=4.0)
    assert adm.hold(now=4.1) == pytest.approx(0.8 * 4 / 8 - 0.1)
    off = _Admission(window=0.0, batch=8)  # no window: no waiting, for anyone
    off.finished(now=0.0, count=8)
    off.add(_sub(4), now=0.0)
    assert _rids(off.due(now=0.0, decoding=0, prefilling=False)) == [4]


def test_a_group_that_fills_the_batch_is_full():
    """Beside 3 decoding rows a batch of 4 has room for one more: an arrival does not wait
    for company that could not enter with it (four users on a batch of four, rows ending
    at different steps, each arrival waited 3/4 of the window)."""
    adm = _Admission(window=0.8, batch=4, max_batch=4)
    adm.add(_sub(1), now=0.0)
    assert adm.group(decoding=3) == (1, True)
    assert _rids(adm.due(now=0.0, decoding=3, prefilling=False)) == [1]
    for rid in (2, 3):
        adm.add(_sub(rid), now=1.0)
    assert _rids(adm.due(now=1.0, decoding=2, prefilling=False)) == [2, 3]  # two fill two places
    adm.add(_sub(4), now=2.0)
    assert adm.due(now=2.0, decoding=2, prefilling=False) == []  # room for two: waits for one more
    assert adm.due(now=2.0, decoding=4, prefilling=False) == []  # no room at all: the window, as ever
    assert _rids(adm.due(now=2.9, decoding=4, prefilling=False)) == [4]
    wide = _Admission(window=0.8, batch=4, max_batch=64)  # room to spare: company is worth a wait
    wide.add(_sub(5), now=0.0)
    assert wide.due(now=0.0, decoding=3, prefilling=False) == []


def test_window_zero_admits_without_waiting_for_company_and_drop_forgets():
    adm = _Admission(window=0.0, batch=8)
    adm.add(_sub(1), now=5.0)
    adm.add(_sub(2), now=5.0)
    assert adm.drop(1) and not adm.drop(1)
    assert _rids(adm.due(now=5.0, decoding=3, prefilling=False)) == [2]


def _trace(path: Path) -> list[dict[str, float]]:
    with open(path) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f, delimiter="\t")]


async def _first_token(stream: trio_mlx.RequestStream) -> None:
    async for ev in stream:
        assert isinstance(ev, trio_mlx.TextDelta), ev
        return


async def _drain(stream: trio_mlx.RequestStream) -> trio_mlx.Finished:
    async for ev in stream:
        if isinstance(ev, trio_mlx.Finished):
            return ev
    raise AssertionError("no Finished event")


@asynccontextmanager
async def _traced_engine(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                         **options: Any) -> AsyncIterator[tuple[trio_mlx.Engine, Path]]:
    """An engine whose actor writes its step trace: (engine, the trace's path), within 60 s."""
    trace = tmp_path / "trace.tsv"
    async with trio_mlx.open_engine(model, step_trace=str(trace), **options) as engine:
        with trio.fail_after(60):
            yield engine, trace


@pytest.mark.parametrize("actor", ["thread", "process"])
async def test_arrivals_during_decode_are_inserted_together(tiny_model_fp32, tmp_path, monkeypatch, actor):
    opts = dict(temperature=0, ignore_eos=True)
    async with _traced_engine(tiny_model_fp32, tmp_path, monkeypatch, max_batch=8, prefill_batch=2,
                              admit_window=60.0, actor=actor) as (engine, trace):
        async with engine.generate("a long one", max_tokens=400, **opts) as first:
            await _first_token(first)  # decoding now
            async with engine.generate("second", max_tokens=4, **opts) as second:
                steps = engine.statistics().decode_steps
                while engine.statistics().decode_steps < steps + 5:  # noqa: ASYNC110
                    await trio.sleep(0.001)
                assert second.stage == "queued"  # held: one arrival is not a prefill batch
                async with engine.generate("third", max_tokens=4, **opts) as third:
                    # two gathered (prefill_batch=2): both enter at the next step
                    assert (await _drain(second)).finish_reason == "length"
                    assert (await _drain(third)).finish_reason == "length"
            assert first.stage == "decode"
    rows = _trace(trace)
    assert min(r["cpu_s"] for r in rows) >= 0 and sum(r["cpu_s"] for r in rows) > 0  # the actor thread's CPU
    inserted = [int(r["inserted"]) for r in rows if r["inserted"]]
    assert inserted == [1, 2], inserted  # the long one alone, then second and third in one step


async def test_an_arrival_that_fills_the_batch_enters_at_once(tiny_model_fp32):
    """max_batch 2 with one row decoding: the batch takes one more, so an arrival enters
    without waiting the window (60 s x 1/2) for a group of two that could not fit."""
    opts = dict(temperature=0, ignore_eos=True)
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=2, prefill_batch=2, admit_window=60.0) as engine:
        with trio.fail_after(60):
            async with engine.generate("a long one", max_tokens=900, **opts) as first:
                await _first_token(first)
                async with engine.generate("second", max_tokens=4, **opts) as second:
                    assert (await _drain(second)).usage.completion_tokens == 4
                assert first.stage == "decode"  # still decoding: the second did not wait for it


async def test_short_prompts_arriving_beside_a_loaded_batch_enter_as_one_group_and_long_ones_by_prefill_batch(
        tiny_model_fp32, tmp_path, monkeypatch):
    """With 8 sequences decoding (`rows`: half of max_batch 16), 6 short prompts arriving together
    enter in one step, past prefill_batch (2): a prefill step costs about the same whatever its
    group's size. The 6 hold 12 tokens, within 2 x prefill_step / 2 = 16; 4 prompts of 16 tokens
    pass that, so they enter 2 at a time, as long prompts always did. Steps of at least 5 ms:
    the 8 outlast the test (at full speed their 1000 tokens sometimes ended before it did)."""
    opts = dict(temperature=0, ignore_eos=True)
    async with _traced_engine(tiny_model_fp32, tmp_path, monkeypatch, max_batch=16, prefill_batch=2,
                              prefill_step=16, admit_window=0.5, prompt_cache_gb=0,
                              fault_hook=slow_steps(0.005)) as (engine, trace):
        async with contextlib.AsyncExitStack() as stack:
            for i in range(8):
                await stack.enter_async_context(engine.generate(f"long {i}", max_tokens=1000, **opts))
            while engine.statistics().decoding < 8:  # noqa: ASYNC110
                await trio.sleep(0.005)
            for prompts in ([f"s{i}" for i in range(6)], [" ".join(["word"] * 12) + f" {i}" for i in range(4)]):
                async with trio.open_nursery() as nursery:
                    for p in prompts:
                        nursery.start_soon(_run_one, engine, p)
            assert engine.statistics().decoding == 8
    inserted = [int(r["inserted"]) for r in _trace(trace) if r["inserted"]]
    # The 8 long-running ones enter as they come (into the idle batch, as many as are there);
    # then the 6 short ones as one group, the 4 long ones 2 at a time.
    assert inserted[-3:] == [6, 2, 2] and sum(inserted[:-3]) == 8, inserted


async def test_a_group_enters_only_after_the_last_one_prefilled(tiny_model_fp32, tmp_path, monkeypatch):
    """Arrivals one step apart never prefill in consecutive steps: the generator
    would otherwise top up its prompt batch every step (groups of 7 and 1...)."""
    opts = dict(temperature=0, ignore_eos=True)
    # No prompt cache: the arrivals share their first tokens, and a hit's prefill of one
    # token runs with its first decode step, so its group's prefill would not show in the trace.
    async with _traced_engine(tiny_model_fp32, tmp_path, monkeypatch, max_batch=16, prefill_batch=4,
                              admit_window=0.0, prompt_cache_gb=0) as (engine, trace):
        async with engine.generate("a long one", max_tokens=600, **opts) as first:
            await _first_token(first)
            async with trio.open_nursery() as nursery:
                for i in range(6):
                    steps = engine.statistics().decode_steps
                    while engine.statistics().decode_steps == steps:  # noqa: ASYNC110
                        await trio.sleep(0.0005)
                    nursery.start_soon(_run_one, engine, f"arrival {i}")
    rows = _trace(trace)
    prefilled = [r["prompt_tokens"] > 0 for r in rows]
    assert sum(prefilled) >= 3  # the arrivals did come in several groups
    assert not any(a and b for a, b in itertools.pairwise(prefilled)), [int(r["prompt_tokens"]) for r in rows]


async def _run_one(engine: trio_mlx.Engine, prompt: str) -> None:
    async with engine.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True) as stream:
        assert (await _drain(stream)).usage.completion_tokens == 8


@asynccontextmanager
async def _one_decoding_one_held(model: Path, first_tokens: int) -> AsyncIterator[tuple[Any, Any, Any]]:
    """An engine with a long window, one request decoding and one held behind it."""
    opts = dict(temperature=0, ignore_eos=True)
    async with trio_mlx.open_engine(model, max_batch=8, admit_window=60.0) as engine:
        with trio.fail_after(60):
            async with engine.generate("first", max_tokens=first_tokens, **opts) as first:
                await _first_token(first)
                async with engine.generate("held", max_tokens=5, **opts) as held:
                    assert held.stage == "queued"
                    yield engine, first, held


async def test_a_held_request_enters_when_the_batch_drains(tiny_model_fp32):
    """With nothing left decoding, waiting would gain nothing: the held request goes in."""
    async with _one_decoding_one_held(tiny_model_fp32, 30) as (_, first, held):
        assert (await _drain(first)).finish_reason == "length"
        fin = await _drain(held)
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == 5


async def test_a_held_request_can_be_aborted(tiny_model_fp32):
    async with _one_decoding_one_held(tiny_model_fp32, 400) as (engine, _, held):
        held.close()
        assert engine.statistics().aborts_by_stage.get("queued") == 1
        # the actor forgot it: only the first one is held
        while engine.statistics().active != 1:  # noqa: ASYNC110
            await trio.sleep(0.001)
        # and the engine still serves
        async with engine.generate("after", max_tokens=3, temperature=0, ignore_eos=True) as after:
            assert (await _drain(after)).usage.completion_tokens == 3


@pytest.mark.parametrize("actor", ["thread", "process"])
async def test_after_a_wave_ends_an_arrival_waits_for_the_others_and_sleeps_meanwhile(
        tiny_model_fp32, tmp_path, monkeypatch, actor):
    opts = dict(temperature=0, ignore_eos=True)
    # The wait runs from the wave's end, not from the arrival: a loaded host that takes its
    # time to send the next request eats into it, so the window leaves a second of margin.
    async with _traced_engine(tiny_model_fp32, tmp_path, monkeypatch, max_batch=8, prefill_batch=4,
                              admit_window=2.0, actor=actor) as (engine, trace):

        async def one(i: int) -> None:
            async with engine.generate(f"wave {i}", max_tokens=3, **opts) as stream:
                await _drain(stream)

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
        # 4 just finished; 1 comes back: held for the other 3, up to 2.0 x 4/4 s from their end
        t0 = trio.current_time()
        async with engine.generate("back", max_tokens=3, **opts) as back:
            await _first_token(back)
            waited = trio.current_time() - t0
            assert (await _drain(back)).usage.completion_tokens == 3
    assert waited > 1.0, waited
    rows = _trace(trace)
    # while it is held the actor sleeps: a handful of empty turns of its loop, not a spin
    empty = [r for r in rows if r["live"] and not (r["inserted"] or r["generated"] or r["prompt_tokens"] or r["rows"])]
    assert len(empty) < 10, len(empty)


def test_admit_window_is_validated():
    with pytest.raises(ValueError, match="admit_window"):
        trio_mlx.Engine(None, admit_window=-1.0)
    with pytest.raises(ValueError, match="admit_window"):
        trio_mlx.Engine(None, admit_window=float("inf"))


_LONG_PROMPTS = [[5 + (7 * i + 13 * k) % 400 for i in range(600)] for k in range(4)]


async def _long_prompt(engine: trio_mlx.Engine, k: int, out: list[list[int]]) -> None:
    """_LONG_PROMPTS[k], greedy, 6 tokens, into out[k]."""
    async with engine.generate(_LONG_PROMPTS[k], temperature=0, ignore_eos=True, max_tokens=6) as events:
        async for ev in events:
            if isinstance(ev, trio_mlx.TextDelta):
                out[k].extend(ev.token_ids)


async def _serve_long_prompts(model: Path, trace: Path, **options: Any) -> tuple[list[list[int]], list[dict[str, float]]]:
    """_LONG_PROMPTS at once (greedy, 6 tokens each; prefill batch 4, steps of 1024, no
    prompt cache): each one's tokens, and the step trace."""
    out: list[list[int]] = [[] for _ in _LONG_PROMPTS]
    async with trio_mlx.open_engine(model, step_trace=str(trace), max_batch=8, prefill_batch=4, prefill_step=1024,
                                    prompt_cache_gb=0, **options) as engine:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for k in range(len(_LONG_PROMPTS)):
                    nursery.start_soon(_long_prompt, engine, k, out)
    return out, _trace(trace)


async def test_long_prompts_prefill_in_chunks_that_bound_attention_scratch(tiny_model_fp32, tmp_path, monkeypatch):
    """The prefill chunk shrinks as prompts x context grows (`_shapes.prefill_chunk`), so
    that a prefill step's attention scores stay within ATTENTION_SCRATCH; the tokens are
    those of an unbounded prefill. On an H100, 8 long prompts beside 64 decoding rows ran
    out of memory in chunks of 2048 (benchmarks/2026-11-24-h100/prefill-memory/)."""
    from trio_mlx.actor import _shapes

    # the tiny model has 4 heads: 5 MB of float32 scores hold 128 tokens of 4 prompts of 600
    monkeypatch.setattr(_shapes, "ATTENTION_SCRATCH", 5_000_000)
    bounded, rows = await _serve_long_prompts(tiny_model_fp32, tmp_path / "bounded.tsv")
    monkeypatch.setattr(_shapes, "ATTENTION_SCRATCH", 1 << 40)
    unbounded, rows_unbounded = await _serve_long_prompts(tiny_model_fp32, tmp_path / "unbounded.tsv")
    assert bounded == unbounded and all(len(t) == 6 for t in bounded)
    assert max(r["prompt_tokens"] for r in rows_unbounded) >= 599  # one step took a whole prompt
    per_step = [r["prompt_tokens"] for r in rows if r["prompt_tokens"]]
    assert max(per_step) <= 512 and sum(per_step) == 4 * 599  # each prompt's last token enters with decode
    assert len(per_step) >= 5


async def test_on_the_shape_grid_unpadded_prompts_prefill_whole(tiny_model_fp32, tmp_path, monkeypatch):
    """On the shape grid (CUDA's, forced here), a prefill step without left padding takes
    the fused attention, which materializes no scores: the actor leaves its chunk whole
    whatever ATTENTION_SCRATCH says (`_batch.CausalPrefill` bounds the padded steps), and
    the tokens are the bounded run's."""
    from trio_mlx.actor import _actor, _shapes

    monkeypatch.setattr(_shapes, "ATTENTION_SCRATCH", 5_000_000)
    monkeypatch.setattr(_actor, "prefill_grid", lambda: True)
    # CUDA's default: no prompt-token budget (the CPU's would cut a fresh actor's first step)
    on_grid, rows = await _serve_long_prompts(tiny_model_fp32, tmp_path / "grid.tsv", warmup=False, prefill_budget=0)
    monkeypatch.setattr(_actor, "prefill_grid", lambda: False)
    cut, rows_cut = await _serve_long_prompts(tiny_model_fp32, tmp_path / "cut.tsv", warmup=False)
    assert on_grid == cut and all(len(t) == 6 for t in on_grid)
    assert max(r["prompt_tokens"] for r in rows_cut) <= 512
    assert max(r["prompt_tokens"] for r in rows) == 4 * 599  # all four whole, in one step


async def _group_beside_a_stream(model: Path, trace: Path, **options: Any) -> tuple[list[list[int]], list[dict[str, float]]]:
    """A stream decodes (greedy, 300 tokens); once it has its first token, _LONG_PROMPTS arrive
    together (prefill batch 4, steps of 1024, no prompt cache): each one's 6 tokens, and the
    step trace."""
    out: list[list[int]] = [[] for _ in _LONG_PROMPTS]
    async with trio_mlx.open_engine(model, step_trace=str(trace), max_batch=8, prefill_batch=4, prefill_step=1024,
                                    prompt_cache_gb=0, admit_window=0.5, **options) as engine:
        with trio.fail_after(60):
            async with engine.generate([5, 6, 7], temperature=0, ignore_eos=True, max_tokens=300) as running:
                await _first_token(running)
                async with trio.open_nursery() as nursery:
                    for k in range(len(_LONG_PROMPTS)):
                        nursery.start_soon(_long_prompt, engine, k, out)
                async for _ in running:  # to its end, so that its steps are in the trace
                    pass
    return out, _trace(trace)


async def test_a_long_group_prefills_within_the_budget_while_a_stream_decodes(tiny_model_fp32, tmp_path):
    """While a stream decodes, a group of long prompts prefills at most
    `prefill_budget` prompt tokens a step (4 prompts of 599 tokens to go, budget 512: chunks
    of 128), and every such step is also a decode step of the running stream, so its tokens
    keep coming between the group's chunks; the group's tokens are those of an unbounded
    prefill, which takes all 2,396 prompt tokens in one step while the stream waits."""
    budgeted, rows = await _group_beside_a_stream(tiny_model_fp32, tmp_path / "budget.tsv", prefill_budget=512)
    whole, rows_whole = await _group_beside_a_stream(tiny_model_fp32, tmp_path / "whole.tsv", prefill_budget=0)
    assert budgeted == whole and all(len(t) == 6 for t in budgeted)
    assert max(r["prompt_tokens"] for r in rows_whole) == 4 * 599  # today's step: the whole group at once
    prefills = [r for r in rows if r["prompt_tokens"]]
    assert prefills[0]["prompt_tokens"] == 2  # the stream's own prompt, alone
    group = prefills[1:]
    assert sum(r["prompt_tokens"] for r in group) == 4 * 599  # each prompt's last token enters with decode
    assert max(r["prompt_tokens"] for r in group) <= 512 and len(group) >= 5
    assert all(r["generated"] >= 1 for r in group)  # the running stream's token, every chunk


async def test_on_the_shape_grid_the_budget_cuts_in_multiples_of_512(tiny_model_fp32, tmp_path, monkeypatch):
    """On CUDA's shape grid (forced here) the budget's chunks are multiples of 512 and never
    under it, so they and the prefixes they leave stay shapes warm-up builds: 4 prompts of
    599 tokens with a budget of 1024 go in a chunk of 512 each and then the rest, each step
    beside the running stream's, with the tokens of the steps off the grid."""
    from trio_mlx.actor import _actor

    monkeypatch.setattr(_actor, "prefill_grid", lambda: True)
    on_grid, rows = await _group_beside_a_stream(tiny_model_fp32, tmp_path / "grid.tsv", prefill_budget=1024,
                                                 warmup=False)
    monkeypatch.setattr(_actor, "prefill_grid", lambda: False)
    off_grid, _ = await _group_beside_a_stream(tiny_model_fp32, tmp_path / "off.tsv", prefill_budget=1024,
                                               warmup=False)
    assert on_grid == off_grid and all(len(t) == 6 for t in on_grid)
    group = [r for r in rows if r["prompt_tokens"]][1:]
    assert [r["prompt_tokens"] for r in group] == [4 * 512, 4 * 87]
    assert all(r["generated"] >= 1 for r in group)


async def test_the_budget_leaves_a_group_whole_when_nothing_decodes(tiny_model_fp32, tmp_path, monkeypatch):
    """Beside no decoding rows the budget cuts a group only where its step would take longer
    than PROGRESS_SECONDS at the prefill rate the actor measured: a fresh actor's first
    chunk stays within the budget (4 x 128) and measures the rate, and the rest goes whole
    (all four prompts in one step, within `prefill_step`). PROGRESS_SECONDS is an hour here:
    at CI's default of 5 s a loaded 2-core host measured its first chunk under 377 tokens a
    second and cut the rest again, [512, 686, 512, 512, 174]."""
    from trio_mlx.actor import _actor

    monkeypatch.setattr(_actor, "PROGRESS_SECONDS", 3600.0)
    _, rows = await _serve_long_prompts(tiny_model_fp32, tmp_path / "idle.tsv", prefill_budget=512)
    assert [r["prompt_tokens"] for r in rows if r["prompt_tokens"]] == [4 * 128, 4 * 471]


async def test_an_idle_batch_s_long_prefill_is_cut_so_that_each_chunk_reports_progress(
        tiny_model_fp32, tmp_path, monkeypatch):
    """Eight ~1.9k-token prompts into an idle CPU server were one step of ~160 s, with
    no report to the engine meanwhile, and /health said "stalled" from 30 s on. A group whose
    step would take longer than PROGRESS_SECONDS at the measured prefill rate goes in chunks
    within the budget, each a step whose report is progress; the tokens are the whole step's."""
    from trio_mlx.actor import _actor

    monkeypatch.setattr(_actor, "PROGRESS_SECONDS", 1e-9)  # any step is too long: the tiny model is fast
    cut, rows = await _serve_long_prompts(tiny_model_fp32, tmp_path / "cut.tsv", prefill_budget=512)
    whole, rows_whole = await _serve_long_prompts(tiny_model_fp32, tmp_path / "whole.tsv", prefill_budget=0)
    assert cut == whole and all(len(t) == 6 for t in cut)
    per_step = [r["prompt_tokens"] for r in rows if r["prompt_tokens"]]
    assert max(per_step) <= 512 and sum(per_step) == 4 * 599 and len(per_step) >= 5
    # no budget: each prompt whole in one step, as before (a loaded host may admit them over
    # more than one step, but never cuts one)
    whole_steps = [r["prompt_tokens"] for r in rows_whole if r["prompt_tokens"]]
    assert sum(whole_steps) == 4 * 599 and all(n % 599 == 0 for n in whole_steps)


def test_the_budget_chunk_fills_the_budget_on_the_rounding_of_prefill_chunk():
    from trio_mlx.actor._shapes import budget_chunk

    assert budget_chunk(2048, [1900] * 8, 0) == 2048  # no budget
    assert budget_chunk(2048, [100] * 32, 4096) == 2048  # short prompts within it go whole
    assert budget_chunk(2048, [1900] * 8, 4096) == 512  # 8 x 512 = 4096
    assert budget_chunk(2048, [1900] * 8, 1024) == 128  # the floor: 8 x 128
    assert budget_chunk(2048, [1900] * 8, 100) == 128  # never under it, whatever the budget
    assert budget_chunk(2048, [1900, 100, 100], 1200) == 512  # short rows leave the long one more
    assert budget_chunk(100, [1900] * 8, 100) == 100  # nor over the configured step
    # on CUDA's shape grid: multiples of 512, so the chunks and their prefixes stay warm-up's shapes
    assert budget_chunk(2048, [1900] * 2, 3072) == 1024
    assert budget_chunk(2048, [1900] * 2, 3072, grid=True) == 1536
    assert budget_chunk(2048, [1900] * 8, 1024, grid=True) == 512
    assert budget_chunk(2048, [300] * 8, 1024, grid=True) == 512
    assert budget_chunk(256, [1900] * 8, 1024, grid=True) == 256


def test_the_prefill_chunk_follows_prompts_context_and_heads():
    from trio_mlx.actor._shapes import prefill_chunk

    gib = 1 << 30
    assert prefill_chunk(2048, 1, 1200, 32, 4 * gib) == 2048  # one prompt of a chat: untouched
    assert prefill_chunk(2048, 8, 7500, 32, 4 * gib) == 512  # eight long ones: the H100's failure
    assert prefill_chunk(2048, 8, 8192, 32, 1 << 20) == 128  # never under 128
    assert prefill_chunk(100, 8, 8192, 32, 1 << 20) == 100  # nor over the configured step
    assert prefill_chunk(2048, 0, 0, 32, 4 * gib) == 2048


def test_the_grid_pads_a_query_to_a_power_of_two_then_to_a_multiple_of_512():
    from trio_mlx.actor._shapes import grid_length, grid_sizes

    assert [grid_length(n) for n in (1, 128, 129, 300, 512)] == [128, 128, 256, 512, 512]
    assert [grid_length(n) for n in (513, 1024, 1351, 2048)] == [1024, 1024, 1536, 2048]  # a chat turn: 1,536
    assert grid_sizes(2048) == [128, 256, 512, 1024, 1536, 2048]
    assert grid_sizes(1000) == [128, 256, 512, 1024]


@pytest.mark.parametrize("actor", ["thread", "process"])
async def test_a_request_into_a_narrow_batch_gets_its_first_token_with_the_step_that_ends_its_prompt(
        tiny_model_fp32, tmp_path, monkeypatch, actor):
    """mlx_lm reports a row's first token at the step after the one that samples it; into a
    batch where at most `EARLY_FIRST_BESIDE` rows decode the actor reads it at once
    (`Actor._first_tokens`), a step sooner, and the tokens are the same; that step's report
    says so (`first`), and the thread's link hands it over at once. Into an empty batch the
    prompt's last token goes through its prefill's forward, which samples the first token
    (`_batch._prompt_end`): one step, not two. A request entering beside more decoding rows
    waits for the step after the one that samples it."""
    from trio_mlx.actor import _link
    from trio_mlx.actor._batch import EARLY_FIRST_BESIDE

    reports = []
    exchange = _link.ThreadLink.exchange

    def recording(self, report):
        reports.append(report)
        return exchange(self, report)

    monkeypatch.setattr(_link.ThreadLink, "exchange", recording)
    opts = dict(temperature=0, ignore_eos=True)
    wide = EARLY_FIRST_BESIDE + 1
    async with _traced_engine(tiny_model_fp32, tmp_path, monkeypatch, actor=actor, max_batch=wide + 1,
                              prompt_cache_gb=0) as (engine, trace):
        alone = await _run_tokens(engine, "The quick brown fox", max_tokens=5, logprobs=True, top_logprobs=2, **opts)
        one = await _run_tokens(engine, "Hello", max_tokens=1, **opts)
        async with engine.generate("a long one", max_tokens=400, **opts) as first:
            await _first_token(first)  # decoding now
            beside = await _run_tokens(engine, "The quick brown fox", max_tokens=5, logprobs=True, top_logprobs=2,
                                       **opts)
            async with contextlib.AsyncExitStack() as stack:
                for i in range(wide - 1):  # with `first`: `wide` rows decoding
                    await _first_token(await stack.enter_async_context(
                        engine.generate(f"another long one {i}", max_tokens=400, **opts)))
                crowded = await _run_tokens(engine, "The quick brown fox", max_tokens=5, **opts)
    rows = _trace(trace)
    # Each request's steps from its insertion. Alone: the prefill, which ends its prompt.
    starts = [i for i, r in enumerate(rows) if r["inserted"]]
    assert len(starts) == 4 + wide
    assert [int(rows[starts[0] + k]["generated"]) for k in range(3)] == [1, 0, 1]  # the repeat is skipped
    assert int(rows[starts[1]]["generated"]) == 1  # max_tokens 1: it ends with its prefill
    # beside one decoding row: its first token with the decoding row's, then the repeat skipped
    assert rows[starts[3] + 1]["generated"] == rows[starts[3] + 1]["rows"] == 2
    assert rows[starts[3] + 2]["generated"] == 1
    # beside `wide` decoding rows: the decoding rows' tokens only, its own a step later
    assert rows[starts[-1] + 1]["generated"] == rows[starts[-1] + 1]["rows"] - 1 == wide
    if actor == "thread":  # the lone request's first token: the first report with tokens, its prefill's
        lone = next(r for r in reports if r.tokens)
        assert lone.first and lone.prompt_tokens and len(lone.tokens) == 1
        # `beside`'s: the step that feeds its prompt's last token with the decoding row's, no prompt
        # tokens of mlx_lm's count, yet handed over at once
        assert any(r.first and not r.prompt_tokens for r in reports)
        assert any(r.tokens and not r.first for r in reports)  # decode steps' reports: held
    assert len(alone[0]) == 5 and alone[0] == beside[0] == crowded[0] and len(one[0]) == 1
    assert len(alone[1]) == 5
    for a, b in zip(alone[1], beside[1], strict=True):  # the first token's logprobs too
        assert (a.token_id, [t for t, _, _ in a.top]) == (b.token_id, [t for t, _, _ in b.top])
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


async def _run_tokens(engine: trio_mlx.Engine, prompt: str, **opts: Any) -> tuple[list[int], list[Any]]:
    """A request's token ids, and its logprobs if it asked for them."""
    async with engine.generate(prompt, **opts) as stream:
        ids: list[int] = []
        lps: list[Any] = []
        async for ev in stream:
            if isinstance(ev, trio_mlx.TextDelta):
                ids += ev.token_ids
                lps += ev.logprobs or ()
        return ids, lps


async def test_the_step_trace_gives_the_wait_for_the_device_once_the_batch_runs_dry(
        tiny_model_fp32, tmp_path, monkeypatch):
    """Once the batch runs dry, its rows leave and the actor waits for the device's queued work
    (their KV copies, the removal) before it reads MLX's memory figures, after the step's
    report went over: a trace line of its own gives that wait as `settle_s`, part of its
    `next_s`, with the batch empty; every other line's is 0."""
    import time

    import mlx.core as mx

    sync = mx.synchronize

    def slow(*args: Any) -> None:
        sync(*args)
        time.sleep(0.02)

    monkeypatch.setattr(mx, "synchronize", slow)
    async with _traced_engine(tiny_model_fp32, tmp_path, monkeypatch, max_batch=4, warmup=False) as (engine, trace):
        async with engine.generate("one", max_tokens=6, temperature=0, ignore_eos=True) as stream:
            assert (await _drain(stream)).finish_reason == "length"
    rows = _trace(trace)  # written out as the actor ended
    dry = [r for r in rows if r["settle_s"] > 0]
    assert len(dry) == 1 and dry[0]["live"] == 0 and dry[0]["rows"] == 0, rows
    assert 0.02 <= dry[0]["settle_s"] <= dry[0]["next_s"]


async def test_a_batch_that_runs_dry_hands_its_last_tokens_over_before_its_rows_leave(tiny_model_fp32, monkeypatch):
    """The step that empties the batch reports its tokens first; its rows' leaving and the wait
    for the device (`Actor.settle`) come after, and then the idle figures: a client's last
    token never waits for them. The wait is held here until the request has ended."""
    import threading

    import mlx.core as mx

    sync, released, waits = mx.synchronize, threading.Event(), []

    def held(*args: Any) -> None:
        waits.append(released.wait(20))  # True: let go by the test, after the request ended
        sync(*args)

    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=4, warmup=False) as engine:
        with trio.fail_after(60):
            monkeypatch.setattr(mx, "synchronize", held)
            async with engine.generate("one", max_tokens=6, temperature=0, ignore_eos=True) as stream:
                assert (await _drain(stream)).finish_reason == "length"
            read_at = engine.statistics().memory_read_at  # the figures the steps read now and then
            assert waits == []
            released.set()
            while engine.statistics().memory_read_at == read_at:  # noqa: ASYNC110
                await trio.sleep(0.01)  # the idle figures, read once the device settled
            monkeypatch.setattr(mx, "synchronize", sync)
    assert waits == [True]


async def test_a_batch_that_runs_dry_hands_its_last_tokens_over_before_its_prompt_cache_copies(
        tiny_model_fp32, monkeypatch):
    """The step that empties the batch reports its tokens before it copies its finished rows' KV
    into the prompt cache (building the copies takes the host time in every row and layer):
    the copy is held here until the request has ended, and the entry is there after it."""
    import threading

    from trio_mlx.actor import _reuse

    copy, released, waits = _reuse.copy_rows, threading.Event(), []

    def held(*args: Any) -> Any:
        waits.append(released.wait(20))  # True: let go by the test, after the request ended
        return copy(*args)

    monkeypatch.setattr(_reuse, "copy_rows", held)
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=4, warmup=False) as engine:
        with trio.fail_after(60):
            async with engine.generate(" ".join(["word"] * 80), max_tokens=6, temperature=0,
                                       ignore_eos=True) as stream:
                assert (await _drain(stream)).finish_reason == "length"
            assert waits == []
            released.set()
            while engine.statistics().prompt_cache_entries == 0:  # noqa: ASYNC110
                await trio.sleep(0.01)
    assert waits == [True]
