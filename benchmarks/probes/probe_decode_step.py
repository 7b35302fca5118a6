"""Probe (GPU investigation): the actor's decode step, owned against mlx-lm's, interleaved in one process.

    python benchmarks/probes/probe_decode_step.py MODEL_DIR [--rows 1,8,64] [--steps 200]
        [--rounds 3] [--mode greedy|sample|grammar] [--out RESULTS.json] [--profile N]

Two actors on the same weights, one per decode step (`ActorTuning.decode_step`:
"owned", `actor/_decode.py`, and "mlx", mlx-lm's GenerationBatch), each driven
through its own `_apply` and `_step` as the server's loop drives it (no engine,
no HTTP, no link crossing: the step alone). For each width, round after round
(the order of the two alternating, since a host's speed drifts), `rows` requests
of 128 random prompt tokens enter, and once all decode, `steps` decode steps are
timed: tokens per second and milliseconds per step. Modes: greedy; sample
(temperature 0.7, top-p 0.9, top-k 50, a seed on every other row, logprobs with
5 top ones on every fourth); grammar (half the rows held to a JSON string by
llguidance, the rest free, greedy). `--profile N`: the owned step alone, one more
round under cProfile, its N costliest functions by own time printed (where the
host's time goes: a device wait shows as `tolist`).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from trio_mlx.actor import Abort, ActorConfig, ActorTuning, Grammar, SamplingParams, Submit
from trio_mlx.actor._actor import Actor
from trio_mlx.actor._constrain import json_string_grammar


class _Link:
    def built(self) -> None:  # nobody waits for the graph here
        pass


def actor(path: Path, step: str, rows: int) -> Actor:
    tuning = ActorTuning(max_batch=max(rows, 8), prefill_batch=min(rows, 8), warmup=False,
                         admit_window=0.0, decode_step=step, prompt_cache_gb=0)
    a = Actor(ActorConfig(model_path=path, tuning=tuning), link=_Link())  # type: ignore[arg-type]
    a._load()
    return a


def submits(mode: str, rows: int, vocab: int, steps: int, rng: random.Random) -> list[Submit]:
    grammar = Grammar(source=json_string_grammar(), min_tokens=2, kind="json_schema")
    out = []
    for i in range(rows):
        prompt = tuple(rng.randrange(10, vocab) for _ in range(128))
        sp, g = SamplingParams(temperature=0.0), None
        if mode == "sample":
            sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=i if i % 2 else None,
                                logprobs=i % 4 == 0, top_logprobs=5 if i % 4 == 0 else 0)
        elif mode == "grammar" and i % 2 == 0:
            g = grammar
        out.append(Submit(10_000 + i, prompt, steps + 64, sp, frozenset(), g))
    return out


def measure(a: Actor, mode: str, rows: int, steps: int, seed: int) -> dict[str, float]:
    return timed_steps(a, submits(mode, rows, a._vocab, steps, random.Random(seed)), steps)


def timed_steps(a: Actor, subs: list[Submit], steps: int) -> dict[str, float]:
    """`subs` entered and prefilled until every one decodes, then `steps` decode steps timed;
    every one aborted and the batch run dry after."""
    rows = len(subs)
    failed = a._apply(subs)
    for _ in range(10_000):  # prefill until every row decodes
        report = a._step(failed or [])
        assert not report.failed, report.failed
        failed = a._apply([])
        if a.schedule.decoding == rows:
            break
    mx.synchronize()
    tokens = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens += len(a._step(a._apply([]) or []).tokens)
    mx.synchronize()
    seconds = time.perf_counter() - t0
    a._apply([Abort(s.rid) for s in subs])
    while a.schedule.seqs or a.schedule.retired:
        a._step(a._apply([]) or [])
    return {"tok_s": tokens / seconds, "ms_step": 1e3 * seconds / steps, "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--rows", default="1,8,64")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mode", choices=("greedy", "sample", "grammar"), default="greedy")
    p.add_argument("--out", type=Path)
    p.add_argument("--profile", type=int, default=0)
    args = p.parse_args()
    if args.profile:
        import cProfile
        import pstats

        for rows in [int(r) for r in args.rows.split(",")]:
            a = actor(args.model, "owned", rows)
            measure(a, args.mode, rows, 16, 0)
            prof = cProfile.Profile()
            prof.enable()
            m = measure(a, args.mode, rows, args.steps, 1)
            prof.disable()
            print(f"rows={rows} {args.mode} owned, profiled: {m['tok_s']:.1f} tok/s {m['ms_step']:.2f} ms/step")
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
            a._free()
        return
    results: list[dict[str, Any]] = []
    for rows in [int(r) for r in args.rows.split(",")]:
        actors = {step: actor(args.model, step, rows) for step in ("owned", "mlx")}
        for a in actors.values():  # untimed: kernels compiled, buffers allocated
            measure(a, args.mode, rows, 16, 0)
        got: dict[str, list[float]] = {"owned": [], "mlx": []}
        for r in range(args.rounds):
            for step in (("owned", "mlx") if r % 2 == 0 else ("mlx", "owned")):
                m = measure(actors[step], args.mode, rows, args.steps, r + 1)
                got[step].append(m["tok_s"])
                results.append({"rows": rows, "mode": args.mode, "step": step, "round": r, **m})
                print(f"rows={rows:4d} {args.mode:8s} {step:6s} round {r}: {m['tok_s']:9.1f} tok/s "
                      f"{m['ms_step']:7.2f} ms/step", flush=True)
        o, m_ = statistics.median(got["owned"]), statistics.median(got["mlx"])
        print(f"rows={rows:4d} {args.mode}: owned {o:.1f} tok/s, mlx {m_:.1f} tok/s, owned/mlx {o / m_:.3f}",
              flush=True)
        for a in actors.values():
            a._free()
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
