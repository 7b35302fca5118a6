"""Finished sequences leave the batch together, not one finishing step at a time.

The actor decides when a sequence is done (max_tokens or a stop token) and
keeps its row in the BatchGenerator for up to TRIO_MLX_RETIRE_STEPS steps, so
that rows leave in the step where new sequences enter, when the batch runs
dry, or when the oldest has waited that long (`actor._actor.Actor._retire_due`).
These tests read the actor's step trace (the `step_trace` option, TRIO_MLX_STEP_TRACE): `retired` is
the finished rows still in the batch, `rows` the decoding batch's size as the
generator itself reports it.
"""

from __future__ import annotations

import csv
import functools
from pathlib import Path

import pytest
import trio

import trio_mlx

OPTS = dict(temperature=0, ignore_eos=True)


def _trace(path: Path) -> list[dict[str, int]]:
    with open(path) as f:
        return [{k: int(float(v)) for k, v in row.items() if k in ("inserted", "live", "retired", "rows")}
                for row in csv.DictReader(f, delimiter="\t")]


async def _tokens(engine: trio_mlx.Engine, prompt: str, **opts: object) -> tuple[list[int], trio_mlx.Finished]:
    ids: list[int] = []
    async with engine.generate(prompt, **opts) as stream:  # type: ignore[arg-type]
        async for ev in stream:
            if isinstance(ev, trio_mlx.TextDelta):
                ids.extend(ev.token_ids)
            elif isinstance(ev, trio_mlx.Finished):
                return ids, ev
    raise AssertionError("no Finished event")


async def _named(out: dict, key: object, engine: trio_mlx.Engine, prompt: str, **opts: object) -> None:
    out[key] = await _tokens(engine, prompt, **opts)


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return tmp_path / "trace.tsv"


async def test_rows_stay_until_the_batch_runs_dry_and_outputs_do_not_change(tiny_model_fp32, tmp_path):
    lengths = [3, 6, 9, 40]
    engine_opts = dict(max_batch=8, prefill_batch=4, retire_steps=1000)
    async with trio_mlx.open_engine(tiny_model_fp32, **engine_opts) as engine:
        alone = [await _tokens(engine, f"prompt {n}", max_tokens=n, **OPTS) for n in lengths]
    # The four must enter as one group, which depends on their submissions reaching the actor
    # before it wakes to the first (an idle batch admits at once): on a loaded machine they
    # once came apart. A fresh engine each try; what is checked is what the group of four does.
    for attempt in range(5):
        trace = tmp_path / f"trace-{attempt}.tsv"
        together: dict[int, tuple[list[int], trio_mlx.Finished]] = {}
        async with trio_mlx.open_engine(tiny_model_fp32, step_trace=str(trace), **engine_opts) as engine:
            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    for n in lengths:
                        nursery.start_soon(functools.partial(_named, together, n, engine, f"prompt {n}",
                                                             max_tokens=n, **OPTS))
            assert engine.statistics().generated_tokens == sum(lengths)  # no retired row's token leaked
        for n, (ids, fin) in zip(lengths, alone, strict=True):
            assert together[n][0] == ids and len(ids) == n
            assert fin.finish_reason == together[n][1].finish_reason == "length"
        rows = _trace(trace)
        if any(r["inserted"] == 4 for r in rows):
            break
    else:
        pytest.fail("the four never entered as one group in five tries")
    rows = rows[max(i for i, r in enumerate(rows) if r["inserted"] == 4):]  # the batch of four
    # all four decode together; the three short ones finish and keep their rows...
    assert max(r["rows"] for r in rows) == 4
    assert [r["retired"] for r in rows if r["live"] == 1][:1] == [3]
    assert all(r["rows"] == 4 for r in rows if r["live"] == 1 and r["retired"])
    # ...until the long one finishes and the batch is emptied in one go
    assert rows[-1]["retired"] == 0 and rows[-1]["rows"] == 0


async def test_rows_leave_when_new_sequences_enter(tiny_model_fp32, trace, monkeypatch):
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=8, admit_window=0.0, retire_steps=1000,
                                    step_trace=str(trace)) as engine:
        with trio.fail_after(60):
            async with engine.generate("a long one", max_tokens=300, **OPTS) as long:
                async for _ in long:
                    break  # decoding
                for i in range(2):
                    ids, fin = await _tokens(engine, f"short {i}", max_tokens=4, **OPTS)
                    assert len(ids) == 4 and fin.finish_reason == "length"
    rows = _trace(trace)
    entered = [i for i, r in enumerate(rows) if r["inserted"]]
    assert len(entered) == 3, entered  # the long one, then each short one
    # the first short one's row was still there when the second arrived, and left as it entered
    before, at = rows[entered[2] - 1], rows[entered[2]]
    assert before["retired"] == 1 and before["rows"] == 2
    assert at["retired"] == 0


async def test_rows_leave_after_at_most_retire_steps(tiny_model_fp32, trace, monkeypatch):
    """A row that ends beside a decoding one is held, then leaves within retire_steps. The
    short row starts once the long one decodes: started together, the short one could end
    before the long one entered (a loaded machine), and no row would be held at all."""
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=8, prefill_batch=2, retire_steps=3,
                                    step_trace=str(trace)) as engine:
        decoding = trio.Event()

        async def long() -> None:
            async with engine.generate("long", max_tokens=200, **OPTS) as stream:  # type: ignore[arg-type]
                async for _ in stream:
                    decoding.set()

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(long)
                await decoding.wait()
                await _tokens(engine, "short", max_tokens=2, **OPTS)
    held = [r["retired"] for r in _trace(trace)]
    assert 1 in held
    assert max(len(run) for run in "".join("x" if h else " " for h in held).split()) <= 4, held


async def test_stop_tokens_and_a_full_context_beside_retired_rows(tiny_model_fp32, tmp_path, monkeypatch):
    """The actor, not the generator, matches stop tokens; a request that fills the
    context has no room for a retired row's extra steps and still ends exactly. "stop" and
    "mid" are held beside "full" only where the three entered as one group: one that enters
    later takes the finished rows out as it enters (above), and on a loaded machine the
    three once came apart. A fresh engine each try, as in the first test."""
    for attempt in range(5):
        trace = tmp_path / f"trace-{attempt}.tsv"
        async with trio_mlx.open_engine(tiny_model_fp32, max_batch=8, prefill_batch=4, retire_steps=1000,
                                        step_trace=str(trace)) as engine:
            ref, _ = await _tokens(engine, "stop here", max_tokens=12, **OPTS)
            stop = next(t for i, t in enumerate(ref) if i >= 2 and t not in ref[:i])
            cut = ref.index(stop) + 1
            room = engine.context_length - len(engine.encode_prompt("text", "to the end"))
            results: dict[str, tuple[list[int], trio_mlx.Finished]] = {}
            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    for key, prompt, opts in (
                            ("stop", "stop here", dict(max_tokens=12, temperature=0, stop_token_ids=[stop])),
                            ("full", "to the end", dict(max_tokens=room, **OPTS)),
                            ("mid", "in between", dict(max_tokens=20, **OPTS))):
                        nursery.start_soon(functools.partial(_named, results, key, engine, prompt, **opts))
        ids, fin = results["stop"]
        assert ids == ref[:cut] and fin.finish_reason == "stop"
        ids, fin = results["full"]
        assert len(ids) == room and fin.finish_reason == "length"
        assert len(results["mid"][0]) == 20
        rows = _trace(trace)
        if any(r["inserted"] == 3 for r in rows):
            break
    else:
        pytest.fail("the three never entered as one group in five tries")
    assert max(r["retired"] for r in rows) == 2  # "stop" and "mid" waited for "full"


async def test_a_bad_retire_setting_fails_the_start_with_its_name(tiny_model_fp32):
    from trio_mlx.server._settings import Settings

    with pytest.raises(ValueError, match="TRIO_MLX_RETIRE_STEPS: expected an integer, got 'lots'"):
        Settings.from_env({"TRIO_MLX_RETIRE_STEPS": "lots"})
    with pytest.raises(ValueError, match="retire_steps must be >= 0"):
        Settings.from_env({}, retire_steps=-1)
    with pytest.raises(ValueError, match="retire_steps"):
        async with trio_mlx.open_engine(tiny_model_fp32, retire_steps=-1):
            pass
