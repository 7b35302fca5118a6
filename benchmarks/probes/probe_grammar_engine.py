"""Probe: what grammar masking costs the served batch, by the share of constrained rows.

    python benchmarks/probes/probe_grammar_engine.py MODEL_DIR [BATCH] [TOKENS] [ROUNDS] [string|array]
    GRAMMAR_MASKS=before python benchmarks/probes/probe_grammar_engine.py ...  # or auto (default: after)
    SHARES=1 python benchmarks/probes/probe_grammar_engine.py ...  # 100% constrained alone (default: 0.5,1)
    TRIO_MLX_STEP_TRACE=FILE python benchmarks/probes/probe_grammar_engine.py ...  # with the actor's step trace
    BUDGET=off python benchmarks/probes/probe_grammar_engine.py ...  # no row measures its budget
    MODES=after,before python benchmarks/probes/probe_grammar_engine.py ...  # modes paired in one engine
    POOL=4 python benchmarks/probes/probe_grammar_engine.py ...  # llguidance's pool at 4 threads
    LEXERS=64 python benchmarks/probes/probe_grammar_engine.py ...  # a grammar's rows over up to 64 lexers
    MASK_COPY=1 python benchmarks/probes/probe_grammar_engine.py ...  # masks handed over as a copy
    PHASES=FILE python benchmarks/probes/probe_grammar_engine.py ...  # the decode step's parts, timed

Asked through the runtime as a server runs it: an `Engine` (thread actor, warmed up) gets BATCH
concurrent greedy `generate` requests of at most TOKENS tokens each, 0%, 50% and 100% of them
carrying `response_format`. Decode tokens/s counts the tokens that arrive once every request has
its first one, until the last ends.

Formats: `string` (the default), a JSON string of at least 100,000 characters: the mask of a
long string, where most tokens are allowed, every step; no budget can complete it, so its rows
run to max_tokens. `array`: an array of 60 strings of at most 12 characters, a schema whose
completion is long, so the per-row budget checks run every step, and whose rows end before
max_tokens (the budget closes the JSON), each at its own step.

`MODES=after,before` (or any modes of `GRAMMAR_MASKS`): one engine runs every constrained batch
once under each mode in every round (the order alternating), the matched free run shared, so the
modes are compared inside one process and one round, where the host's drift between engines does
not reach; prints each mode's figures and, per round, each mode's constrained rate over the
first's (the same tokens under every mode). The mode is switched on the actor's `Decoder` between
batches (a thread actor, in this process).

`POOL=N`: llguidance's pool at N threads instead of `_constrain.POOL_THREADS`'s 80% of the usable
CPUs, and the most lexers a grammar's rows are dealt across by the runtime's rule for it
(`_constrain.lexers_for`; a thread actor, in this process).
`LEXERS=N`: the most lexers a grammar's rows are dealt across (`_constrain.LEXERS`), the pool
left as it is.

`MASK_COPY=1`: each step hands its masks to the device as a copy of the filled bitmask
(`mx.array`), as the decoder did before it filled them in place into MLX arrays of its own
(`_decode._Plan`), for an A/B of the two in separate engines.

`BUDGET=off`: no constrained row ever measures itself against its max_tokens (its first
check is put past any step), so the figures leave out what the budget checks cost; an array's
rows may then run to max_tokens with unfinished JSON (a timing experiment only).

`PHASES=FILE`: every call of the decode step's parts is timed, with the thread that made it,
into FILE (tab-separated: thread, part, start, end; `phases.py` in
benchmarks/2026-11-30-h200/grammar-steps reads it): the step (`_batch._owned_step`), the decoder's
`masks_first`, `step`, the masks' fill (`_fill_masks`) and its consume, batch fill and budget
checks, the wait for masks started early, the sampling's graph (`_sample`), and each
`mx.async_eval` the decoder makes.

Free rows run with `ignore_eos`. Three figures per constrained share, each a ratio of tokens/s:

- "same tokens" (the fair one): against free rows given the same per-row token counts
  (max_tokens = the completion_tokens each constrained row got in the share's last run, the
  free rows of a 50% batch keeping TOKENS), so that both batches thin out alike as their rows
  end. Each share's constrained run and its matched free run are paired in every round (the
  order alternates with the rounds; a round's matched run may take the counts of the round
  before, which the probe checks for drift: greedy rows of a random model repeat their counts).
- "full width": tokens/s while every row of the batch is still decoding (from the moment each
  has its first token until the first one ends) against the same for the 0% batch: the decode
  step's rate at the batch's full width.
- "to max_tokens" (the figure this probe printed before): against the free rows run to TOKENS.
  Where the constrained rows end early it counts the thinned tail of their batch against a full
  one, so it understates the grammar's rate.

The shares alternate over ROUNDS rounds because the host's speed drifts; each figure is the
median over rounds of the paired ratio. Use a random-weight model
(`trio-mlx model build DIR --shape llama-3.2-1b --dtype bfloat16`).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import trio

import trio_mlx

# A string no budget can complete (its shortest completion is past what the engine
# looks for, so the row is masked every step until max_tokens cuts it).
STRING = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "minLength": 100_000}}}
ARRAY = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
    "type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 60, "maxItems": 60}}}
# The constrained shares measured beside 0% (`SHARES=1` for every row constrained alone).
SHARES = (0.0, *(float(x) for x in os.environ.get("SHARES", "0.5,1").split(",")))
FORMAT = STRING


@dataclass
class Level:
    rate: float  # decode tokens/s, every request's first token to the last one's end
    full: float  # ... while every row was still decoding
    counts: list[int]  # completion_tokens, per row (the steps it decoded, EOS included)


async def level(engine: trio_mlx.Engine, batch: int, tokens: int, share: float,
                limits: list[int] | None = None) -> Level:
    """One batch: `share` of it constrained; with `limits`, every row free, row i given
    max_tokens limits[i]."""
    constrained = 0 if limits is not None else round(batch * share)
    first: list[float] = []
    counts = [0] * batch  # tokens each request has received
    steps = [0] * batch  # ... its completion_tokens, at its end
    marks: list[int] = []  # counts when every request had its first token
    at_first_end: list[int] = []  # ... when the first request ended
    ends: list[float] = []
    clock = time.perf_counter

    async def one(i: int) -> None:
        fmt = FORMAT if i < constrained else None
        cap = tokens if limits is None else limits[i]
        async with engine.generate(f"Row {i}: a long JSON string about mountains.", max_tokens=cap,
                                   temperature=0.0, ignore_eos=True, response_format=fmt) as events:
            async for ev in events:
                if isinstance(ev, trio_mlx.TextDelta):
                    if counts[i] == 0:
                        first.append(clock())
                        if len(first) == batch:
                            marks.extend(counts)
                    counts[i] += len(ev.token_ids)
                elif isinstance(ev, trio_mlx.Finished):
                    steps[i] = ev.usage.completion_tokens
                    ends.append(clock())
                    if not at_first_end:
                        at_first_end.extend(counts)

    async with trio.open_nursery() as nursery:
        for i in range(batch):
            nursery.start_soon(one, i)
    end = clock()
    start = max(first)
    full_time = min(ends) - start
    full = (sum(at_first_end) - sum(marks)) / full_time if full_time > 0 else float("nan")
    return Level((sum(counts) - sum(marks)) / (end - start), full, steps)


def describe(counts: list[int], tokens: int) -> str:
    short = [c for c in counts if c < tokens]
    if not short:
        return "every row ran to max_tokens"
    return (f"{len(short)} of {len(counts)} rows ended before max_tokens: completion tokens "
            f"min {min(counts)}, median {statistics.median(counts):.0f}, max {max(counts)}, "
            f"{sum(counts) / (len(counts) * tokens):.0%} of the full batch's")


def _no_budget_checks() -> None:
    """`BUDGET=off`: every GrammarProcessor made from now on has its first check out of reach."""
    from trio_mlx.actor import _constrain

    init = _constrain.GrammarProcessor.__init__

    def unchecked(self: _constrain.GrammarProcessor, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        self._check_at = 1 << 62

    _constrain.GrammarProcessor.__init__ = unchecked  # type: ignore[method-assign]


# The mode every decode step takes under `MODES` (`_switch_modes`), and the steps under each
# whose masks were filled beside the forward's encoding (`masks_first` took them).
MODE = ["after"]
EARLY: dict[str, int] = {}


def _switch_modes() -> None:
    """`MODES`: every Decoder takes `MODE[0]` at each step (`masks_first` starts every grammar
    step, and `step` follows what it chose)."""
    from trio_mlx.actor import _decode

    first = _decode.Decoder.masks_first

    def switched(self: _decode.Decoder, *args: object, **kwargs: object) -> object:
        self.grammar_masks = MODE[0]
        early = first(self, *args, **kwargs)  # type: ignore[arg-type]
        if early is not None:
            EARLY[MODE[0]] = EARLY.get(MODE[0], 0) + 1
        return early

    _decode.Decoder.masks_first = switched  # type: ignore[method-assign,assignment]


async def paired_modes(engine: trio_mlx.Engine, batch: int, tokens: int, rounds: int, modes: list[str]) -> None:
    """`MODES`: 100% constrained under each mode against free rows with the same tokens."""
    MODE[0] = modes[0]
    counts = (await level(engine, batch, tokens, 1.0)).counts
    print(f"warm-up: {describe(counts, tokens)}", flush=True)
    fair: dict[str, list[float]] = {m: [] for m in modes}
    full: dict[str, list[float]] = {m: [] for m in modes}
    over: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds):
        free = await level(engine, batch, tokens, 0.0)
        same = await level(engine, batch, tokens, 1.0, limits=counts)
        got: dict[str, Level] = {}
        for m in modes if r % 2 == 0 else modes[::-1]:
            MODE[0] = m
            got[m] = await level(engine, batch, tokens, 1.0)
        for m in modes:
            fair[m].append(got[m].rate / same.rate)
            full[m].append(got[m].full / free.full)
            over[m].append(got[m].rate / got[modes[0]].rate)
        print(f"round {r + 1}: free {free.rate:.0f} tok/s, same tokens free {same.rate:.0f}, "
              + ", ".join(f"{m} {got[m].rate:.0f} ({over[m][-1]:.2f}x {modes[0]})" for m in modes), flush=True)
    for m in modes:
        print(f"{m}: {statistics.median(fair[m]):.2f}x of free rows with the same tokens (fair), "
              f"{statistics.median(full[m]):.2f}x at full width, {statistics.median(over[m]):.2f}x {modes[0]} "
              f"(medians over {rounds} rounds); {EARLY.get(m, 0)} steps filled their masks early")


PHASE_LOG: list[tuple[str, str, float, float]] = []


def _time_phases() -> None:
    """`PHASES`: wrap the decode step's parts so that each call's start and end are kept."""
    import threading
    import types

    import mlx.core as mx

    from trio_mlx.actor import _batch, _constrain, _decode

    clock = time.perf_counter

    def timed(name: str, fn: Any, rows: bool = False) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                label = f"{name}:{len(args[1])}" if rows else name  # the step: its batch's rows
                PHASE_LOG.append((threading.current_thread().name, label, t0, clock()))
        return wrapper

    _batch._owned_step = timed("owned_step", _batch._owned_step, rows=True)  # before `own_decode` binds it
    if hasattr(_decode, "_measure_all"):  # a tree whose budget checks ran in a thread, beside the fill
        _decode._measure_all = timed("measure", _decode._measure_all)
    else:  # later ones: each row's, after the fill
        _constrain.GrammarProcessor._measure = timed("measure", _constrain.GrammarProcessor._measure)
    for name in ("masks_first", "step", "_fill_masks", "_consume_many", "_fill_many", "_sample"):
        setattr(_decode.Decoder, name, timed(name.lstrip("_"), getattr(_decode.Decoder, name)))
    _decode._Early.wait = timed("early_wait", _decode._Early.wait)  # type: ignore[method-assign]
    proxy = types.SimpleNamespace(**{k: getattr(mx, k) for k in dir(mx) if not k.startswith("__")})
    proxy.async_eval = timed("async_eval", mx.async_eval)
    _decode.mx = proxy  # type: ignore[assignment]


async def main() -> None:
    if os.environ.get("PHASES"):
        _time_phases()
    if os.environ.get("BUDGET") == "off":
        _no_budget_checks()
    if os.environ.get("MASK_COPY") == "1":
        import mlx.core as mx
        import numpy as np

        from trio_mlx.actor import _decode

        _decode.Decoder._mask_array = staticmethod(  # type: ignore[method-assign]
            lambda plan: mx.array(plan.bitmask.view(np.uint32)))
    if os.environ.get("POOL") or os.environ.get("LEXERS"):
        from trio_mlx.actor import _constrain

        if os.environ.get("POOL"):
            _constrain.POOL_THREADS = int(os.environ["POOL"])
            _constrain.LEXERS = _constrain.lexers_for(_constrain.POOL_THREADS)
        if os.environ.get("LEXERS"):
            _constrain.LEXERS = int(os.environ["LEXERS"])
    modes = [m for m in os.environ.get("MODES", "").split(",") if m]
    if modes:
        _switch_modes()
    path = sys.argv[1]
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    global FORMAT
    FORMAT = ARRAY if len(sys.argv) > 5 and sys.argv[5] == "array" else STRING
    shares = [s for s in SHARES if s]
    masks = os.environ.get("GRAMMAR_MASKS", "after")  # ActorTuning.grammar_masks
    trace = os.environ.get("TRIO_MLX_STEP_TRACE")  # the actor's step trace, as a server's
    if modes:
        async with trio_mlx.open_engine(path, max_batch=batch, prefill_batch=min(batch, 8),
                                        step_trace=trace) as engine:
            await paired_modes(engine, batch, tokens, rounds, modes)
        return
    async with trio_mlx.open_engine(path, max_batch=batch, prefill_batch=min(batch, 8),
                                    grammar_masks=masks, step_trace=trace) as engine:
        # warm-up: the grammar path's kernels (an array needs room for its sure completion),
        # and each share's per-row counts for the first matched run
        last: dict[float, list[int]] = {}
        for s in shares:
            last[s] = (await level(engine, batch, tokens, s)).counts
            print(f"warm-up {int(s * 100)}%: {describe(last[s][:round(batch * s)], tokens)}", flush=True)
        free: list[Level] = []
        runs: dict[float, list[tuple[Level, Level]]] = {s: [] for s in shares}
        for r in range(rounds):
            line = []
            if r % 2 == 0:
                free.append(await level(engine, batch, tokens, 0.0))
            for s in shares if r % 2 == 0 else reversed(shares):
                pair: list[Level] = []
                for matched in (False, True) if r % 2 == 0 else (True, False):
                    if matched:
                        pair.append(await level(engine, batch, tokens, s, limits=last[s]))
                    else:
                        got = await level(engine, batch, tokens, s)
                        drift = sum(a != b for a, b in zip(got.counts, last[s], strict=True))
                        if drift:
                            print(f"  note: {drift} rows' counts differ from the last {int(s * 100)}% run")
                        last[s] = got.counts
                        pair.append(got)
                con, same = pair if r % 2 == 0 else pair[::-1]
                runs[s].append((con, same))
                line.append(f"{int(s * 100)}%: {con.rate:.0f} tok/s (same tokens free: {same.rate:.0f})")
            if r % 2 == 1:
                free.append(await level(engine, batch, tokens, 0.0))
            print(f"round {r + 1}: 0%: {free[-1].rate:.0f} tok/s, " + ", ".join(line), flush=True)
        device = engine.info.device if engine.info else "?"
    print(f"  0% constrained: median {statistics.median(f.rate for f in free):.0f} tok/s, "
          f"{statistics.median(f.full for f in free):.0f} at full width "
          f"(engine, batch {batch}, {tokens} tokens, {device})")
    for s in shares:
        pairs = runs[s]
        rate = statistics.median(c.rate for c, _ in pairs)
        fair = statistics.median(c.rate / m.rate for c, m in pairs)
        full = statistics.median(c.full / f.full for (c, _), f in zip(pairs, free, strict=True))
        old = statistics.median(c.rate / f.rate for (c, _), f in zip(pairs, free, strict=True))
        print(f"{int(s * 100):3d}% constrained: median {rate:.0f} tok/s; {fair:.2f}x of free rows with the "
              f"same tokens (fair), {full:.2f}x at full width, {old:.2f}x of free rows run to max_tokens "
              f"(unmatched, the old figure); {describe(pairs[-1][0].counts[:round(batch * s)], tokens)}")


if __name__ == "__main__":
    trio.run(main)
    if os.environ.get("PHASES"):
        with open(os.environ["PHASES"], "w") as f:
            for thread, name, t0, t1 in PHASE_LOG:
                f.write(f"{thread}\t{name}\t{t0:.6f}\t{t1:.6f}\n")
