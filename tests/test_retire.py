"""Finished sequences leave the batch together, not one finishing step at a time.

The actor decides when a sequence is done (max_tokens or a stop token) and
keeps its row in the BatchGenerator for up to TRIO_MLX_RETIRE_STEPS steps, so
that rows leave in the step where new sequences enter, when the batch runs
dry, or when the oldest has waited that long (`_actor.Actor._retire_due`).
These tests read the actor's step trace (TRIO_MLX_STEP_TRACE): `retired` is
the finished rows still in the batch, `rows` the decoding batch's size as the
generator itself reports it.
"""

from __future__ import annotations

import csv
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


@pytest.fixture
def trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "trace.tsv"
    monkeypatch.setenv("TRIO_MLX_STEP_TRACE", str(path))
    return path


async def test_rows_stay_until_the_batch_runs_dry_and_outputs_do_not_change(tiny_model_fp32, trace, monkeypatch):
    monkeypatch.setenv("TRIO_MLX_RETIRE_STEPS", "1000")
    lengths = [3, 6, 9, 40]
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=8, prefill_batch=4) as engine:
        alone = [await _tokens(engine, f"prompt {n}", max_tokens=n, **OPTS) for n in lengths]
        together: dict[int, tuple[list[int], trio_mlx.Finished]] = {}

        async def one(n: int) -> None:
            together[n] = await _tokens(engine, f"prompt {n}", max_tokens=n, **OPTS)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for n in lengths:
                    nursery.start_soon(one, n)
        assert engine.statistics().generated_tokens == 2 * sum(lengths)  # no retired row's token leaked
    for n, (ids, fin) in zip(lengths, alone, strict=True):
        assert together[n][0] == ids and len(ids) == n
        assert fin.finish_reason == together[n][1].finish_reason == "length"
    rows = _trace(trace)
    rows = rows[max(i for i, r in enumerate(rows) if r["inserted"] == 4):]  # the batch of four
    # all four decode together; the three short ones finish and keep their rows...
    assert max(r["rows"] for r in rows) == 4
    assert [r["retired"] for r in rows if r["live"] == 1][:1] == [3]
    assert all(r["rows"] == 4 for r in rows if r["live"] == 1 and r["retired"])
    # ...until the long one finishes and the batch is emptied in one go
    assert rows[-1]["retired"] == 0 and rows[-1]["rows"] == 0


async def test_rows_leave_when_new_sequences_enter(tiny_model_fp32, trace, monkeypatch):
    monkeypatch.setenv("TRIO_MLX_RETIRE_STEPS", "1000")
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=8, admit_window=0.0) as engine:
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
    monkeypatch.setenv("TRIO_MLX_RETIRE_STEPS", "3")
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=8, prefill_batch=2) as engine:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: _tokens(engine, "short", max_tokens=2, **OPTS))
                nursery.start_soon(lambda: _tokens(engine, "long", max_tokens=40, **OPTS))
    held = [r["retired"] for r in _trace(trace)]
    assert 1 in held
    assert max(len(run) for run in "".join("x" if h else " " for h in held).split()) <= 4, held


async def test_stop_tokens_and_a_full_context_beside_retired_rows(tiny_model_fp32, trace, monkeypatch):
    """The actor, not the generator, matches stop tokens; a request that fills the
    context has no room for a retired row's extra steps and still ends exactly."""
    monkeypatch.setenv("TRIO_MLX_RETIRE_STEPS", "1000")
    async with trio_mlx.open_engine(tiny_model_fp32, max_batch=8, prefill_batch=4) as engine:
        ref, _ = await _tokens(engine, "stop here", max_tokens=12, **OPTS)
        stop = next(t for i, t in enumerate(ref) if i >= 2 and t not in ref[:i])
        cut = ref.index(stop) + 1
        room = engine.context_length - len(engine.encode_prompt("text", "to the end"))
        results: dict[str, tuple[list[int], trio_mlx.Finished]] = {}

        async def one(key: str, prompt: str, **opts: object) -> None:
            results[key] = await _tokens(engine, prompt, **opts)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: one("stop", "stop here", max_tokens=12, temperature=0,
                                               stop_token_ids=[stop]))
                nursery.start_soon(lambda: one("full", "to the end", max_tokens=room, **OPTS))
                nursery.start_soon(lambda: one("mid", "in between", max_tokens=20, **OPTS))
    ids, fin = results["stop"]
    assert ids == ref[:cut] and fin.finish_reason == "stop"
    ids, fin = results["full"]
    assert len(ids) == room and fin.finish_reason == "length"
    assert len(results["mid"][0]) == 20
    assert max(r["retired"] for r in _trace(trace)) == 2  # "stop" and "mid" waited for "full"


async def test_a_bad_retire_setting_fails_the_start_with_its_name(tiny_model_fp32, monkeypatch):
    monkeypatch.setenv("TRIO_MLX_RETIRE_STEPS", "lots")
    with pytest.raises(Exception, match="TRIO_MLX_RETIRE_STEPS must be a number >= 0, not 'lots'"):
        async with trio_mlx.open_engine(tiny_model_fp32):
            pass


def _step_tokens(bg, out: dict[int, list[int]]) -> None:
    _, generated = bg.next()
    for r in generated:
        out.setdefault(r.uid, []).append(r.token)


def _caches_state(bg) -> list[tuple[list, list, list, list, int]]:
    import mlx.core as mx

    caches = bg._generation_batch.prompt_cache
    mx.eval([c.state[:4] for c in caches])
    return [(c.keys[..., : c._idx, :].tolist(), c.values[..., : c._idx, :].tolist(), c.offset.tolist(),
             c.left_padding.tolist(), c._idx) for c in caches]


def test_removal_with_one_padding_read_keeps_every_cache_and_token_as_the_stock_filter(tiny_model_fp32):
    """`_actor._remove_rows` replaces mlx_lm's per-layer host reads of the padding with
    one read: the caches after each removal, and every token after, must be the
    stock `BatchGenerator.remove`'s, including removals that trim the shared padding."""
    import random

    from mlx_lm.generate import BatchGenerator

    from trio_mlx import _actor, _models

    model, config = _models.load_model(tiny_model_fp32)
    vocab = int(config["vocab_size"])

    def run(remove) -> tuple[dict[int, list[int]], list, int]:
        rng = random.Random(7)
        bg = BatchGenerator(model, max_tokens=10**6, completion_batch_size=64, prefill_batch_size=4)
        out: dict[int, list[int]] = {}
        live: list[int] = []
        states, trimmed = [], 0
        for _ in range(5):
            live += bg.insert([[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 24))] for _ in range(4)])
            for _ in range(5):
                _step_tokens(bg, out)
            before = bg._generation_batch.prompt_cache[0]._idx
            gone, live = live[:3], live[3:]  # the oldest rows: their removal trims the padding
            remove(bg, gone)
            trimmed += bg._generation_batch.prompt_cache[0]._idx < before
            states.append(_caches_state(bg))
        for _ in range(6):
            _step_tokens(bg, out)
        return out, states, trimmed

    stock = run(lambda bg, uids: bg.remove(uids))
    fast = run(_actor._remove_rows)
    assert stock[2] >= 2  # the shared padding was trimmed, so that path is compared too
    assert fast[1] == stock[1]
    assert fast[0] == stock[0] and len(fast[0]) == 20  # every sequence made tokens


def test_removal_leaves_no_filter_override_behind(tiny_model_fp32):
    from mlx_lm.generate import BatchGenerator

    from trio_mlx import _actor, _models

    model, _ = _models.load_model(tiny_model_fp32)
    bg = BatchGenerator(model, max_tokens=10**6, completion_batch_size=8, prefill_batch_size=4)
    uids = bg.insert([[5, 6, 7], [8, 9], [10, 11, 12, 13]])
    for _ in range(4):
        bg.next()
    caches = list(bg._generation_batch.prompt_cache)
    _actor._remove_rows(bg, uids[:1])
    assert all("filter" not in vars(c) for c in caches)
    assert len(bg._generation_batch) == 2
