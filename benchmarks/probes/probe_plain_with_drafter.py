"""Probe: what a plain decode step costs with speculative decoding on but nothing drafted.

    PYTHONPATH=. python benchmarks/probes/probe_plain_with_drafter.py MODEL_DIR [--rows 1,4] [--rounds 2] [--warm]

On an H200 a batch's plain steps took ~2-3 ms longer with `--speculative ngram` than
without, at one row and at four, while almost nothing was drafted. This drives the actor
directly (its own `_apply` and `_step`; the warm-up off, or with `--warm` run as a server
runs it, rehearsal included), greedy rows on random 128-token
prompts, 256 tokens each, and reports the median wall time of a step (the steps after
the first 16) for:

- `off`: no speculation;
- `ngram`: prompt lookup as it runs;
- `no-propose`: prompt lookup with the drafter's `propose` answering "no drafts" for
  every row without looking at anything;
- `no-spec-step`: prompt lookup with the speculative step declining at once (what is
  left is `_batch._owned_next`'s own bookkeeping: `first_token_waits`, the plain step's timing).

Each variant runs in every round, the order reversed in odd rounds (the host drifts).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

from trio_mlx.actor import ActorConfig, ActorTuning, SamplingParams, Submit
from trio_mlx.actor._actor import Actor
from trio_mlx.actor._drafting import Drafter

GREEDY = SamplingParams(temperature=0.0)


class _Link:
    def built(self) -> None:
        pass


def actor(path: Path, warm: bool = False, **tuning: Any) -> Actor:
    a = Actor(ActorConfig(model_path=path, tuning=ActorTuning(warmup=warm, admit_window=0.0, **tuning)),
              link=_Link())  # type: ignore[arg-type]
    a._load()
    if warm:
        a._warmup()
    return a


def serve(a: Actor, subs: list[Submit]) -> list[float]:
    """Step until every row has ended: each step's wall seconds."""
    times: list[float] = []
    commands: list[Any] = list(subs)
    while True:
        t0 = time.perf_counter()
        failed = a._apply(commands)
        report = a._step(failed or [])
        times.append(time.perf_counter() - t0)
        assert not report.failed, report.failed
        commands = []
        if not a.schedule.seqs:
            return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("--rows", default="1,4")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--warm", action="store_true", help="warm each actor up as a server's is")
    args = p.parse_args()
    rng = random.Random(0)
    plain, spec = actor(args.model, args.warm), actor(args.model, args.warm, speculative="ngram")
    top = min(30000, plain._vocab)  # prompts of ordinary ids (an id past the embedding crashes the CPU build)
    propose, step = Drafter.propose, spec._drafter.step  # type: ignore[union-attr]
    rid = 0
    results: dict[tuple[str, int], list[float]] = {}
    variants = ["off", "ngram", "no-propose", "no-spec-step"]
    for r in range(args.rounds):
        for rows in (int(x) for x in args.rows.split(",")):
            for v in variants if r % 2 == 0 else variants[::-1]:
                Drafter.propose = propose  # type: ignore[method-assign]
                spec._drafter.step = step  # type: ignore[union-attr]
                if v == "no-propose":
                    Drafter.propose = lambda self, rs, helds, pending: [None] * len(rs)  # type: ignore[method-assign]
                elif v == "no-spec-step":
                    spec._drafter.step = lambda decoder, batch: None  # type: ignore[union-attr]
                subs = []
                for _ in range(rows):
                    rid += 1
                    subs.append(Submit(rid, tuple(rng.randrange(top // 3, top) for _ in range(128)), args.tokens,
                                       GREEDY, frozenset()))
                times = serve(plain if v == "off" else spec, subs)
                ms = statistics.median(times[16:]) * 1000
                results.setdefault((v, rows), []).append(ms)
                print(f"round {r + 1} rows {rows} {v:13s} {ms:.2f} ms a step ({len(times)} steps)", flush=True)
    for (v, rows), ms in sorted(results.items(), key=lambda kv: (kv[0][1], variants.index(kv[0][0]))):
        print(f"rows {rows} {v:13s} median {statistics.median(ms):.2f} ms  ({', '.join(f'{m:.2f}' for m in ms)})")


if __name__ == "__main__":
    main()
