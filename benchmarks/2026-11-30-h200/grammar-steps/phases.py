"""probe_grammar_engine.py's `PHASES` file: the decode steps of a constrained batch at one width,
part by part (median ms per step), on the actor thread and on the masks' threads.

    python3 phases.py PHASES.tsv [ROWS]

A step is one `owned_step:ROWS` call of the actor thread (default 64 rows); the parts inside it
are the calls the probe timed that started within it, on any thread. `build` is the time from the
step's start to the decoder's first call (the forward's graph, in Python); `step` is what the
decoder's `step` spent outside the calls timed inside it (reading last step's tokens, the plan),
`masks_first` the whole of its call (its read of last step's tokens first); `gap` is the time from the step's end to the next step's start (the actor's own work:
the report, the link, admissions). Steps with grammar rows and steps without are told apart by
whether the masks were filled.
"""

from __future__ import annotations

import bisect
import collections
import statistics
import sys


def main() -> None:
    path = sys.argv[1]
    width = sys.argv[2] if len(sys.argv) > 2 else "64"
    calls = [(th, name, float(a), float(b)) for th, name, a, b in
             (line.rstrip("\n").split("\t") for line in open(path))]
    steps = sorted((a, b) for th, name, a, b in calls if name == f"owned_step:{width}")
    allsteps = sorted(a for th, name, a, b in calls if name.startswith("owned_step:"))
    others = sorted(((a, b, th, name) for th, name, a, b in calls if not name.startswith("owned_step")))
    starts = [o[0] for o in others]
    parts: dict[bool, collections.defaultdict[str, list[float]]] = {
        True: collections.defaultdict(list), False: collections.defaultdict(list)}
    for a, b in steps:
        inside = others[bisect.bisect_left(starts, a):bisect.bisect_right(starts, b)]
        grammar = any(n == "fill_masks" for _, _, _, n in inside)
        got = collections.defaultdict(float)
        got["whole step"] = b - a
        firsts = [s for s, _, th, n in inside if n in ("masks_first", "step")]
        got["build"] = (min(firsts) - a) if firsts else 0.0
        actor = [(s, e, n) for s, e, th, n in inside if n in ("masks_first", "step", "early_wait", "sample", "async_eval")]
        evals = [(s, e) for s, e, n in actor if n == "async_eval"]
        for s, e, n in actor:
            if n == "async_eval":
                continue
            got[n] += e - s
        if "step" in got:  # what `step` spent outside the calls timed in it: reads, the plan
            got["step"] -= sum(got[n] for n in ("early_wait", "sample")) + sum(e - s for s, e in evals
                                                                              if any(s >= s0 and e <= e0 for s0, e0, n in actor if n == "step"))
        if len(evals) >= 2:
            got["async_eval forward"] = evals[0][1] - evals[0][0]
            got["async_eval sampling"] = sum(e - s for s, e in evals[1:])
        elif evals:
            got["async_eval (one)"] = evals[0][1] - evals[0][0]
        for s, e, th, n in inside:
            if n in ("fill_masks", "consume_many", "fill_many", "measure"):
                got[f"[{th[:18]}] {n}"] += e - s
        j = bisect.bisect_right(allsteps, a)
        if j < len(allsteps):
            got["gap to next step"] = allsteps[j] - b
        for k, v in got.items():
            parts[grammar][k].append(v * 1e3)
    for grammar in (True, False):
        got = parts[grammar]
        if not got["whole step"]:
            continue
        print(f"{'with grammar rows' if grammar else 'free'}: {len(got['whole step'])} steps at {width} rows, median ms")
        for k, v in got.items():
            print(f"  {k:38s} {statistics.median(v):7.3f}   (p10 {statistics.quantiles(v, n=10)[0]:.3f}, "
                  f"p90 {statistics.quantiles(v, n=10)[-1]:.3f}, in {len(v)} steps)")


if __name__ == "__main__":
    main()
