"""Read phase.py's PHASE_OUT: median ms of each phase in the step that inserts a prompt beside
decoding rows (owned_generate in a step whose batch already decoded) and the 4 after it, and in
plain steps. `python phases.py FILE...`."""
import collections
import csv
import statistics
import sys

DERIVED = ("wait", "fwd_build")
brief = sys.argv[1] == "--brief"
for name in sys.argv[1 + brief:]:
    per: dict[int, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    with open(name) as f:
        for r in csv.DictReader(f, delimiter="\t"):
            per[int(r["step"])][r["phase"]] += float(r["ms"])
    for s in per.values():
        s["wait"] = s["dec.step"] - s["dec.plan"] - s["dec.sample"] - s["async_eval"]
        s["fwd_build"] = s["owned_step"] - s["unmask"] - s["dec.step"]
    steps = sorted(per)
    decoding = {s for s in steps if per[s]["owned_step"] > 0 and per[s]["owned_generate"] == 0
                or per[s]["owned_step"] > 1.5}
    ins = [s for s in steps if per[s]["owned_generate"] > 0 and (s - 1) in decoding]
    busy = {s + d for s in ins for d in range(-1, 6)}
    plain = [s for s in steps if s not in busy and per[s]["prefill"] == 0 and per[s]["gen.filter"] == 0
             and per[s]["owned_step"] > 0]
    phases = ["STEP", "bg.next", "prefill", "owned_generate", "split_rows", "gen.extend", "gen.filter",
              "remove_rows", "unmask", "owned_step", "fwd_build", "dec.step", "dec.plan", "dec.sample",
              "async_eval", "wait", "actor.tokens", "actor.first_tokens", "reuse.prefilled",
              "reuse.leaving", "actor.apply", "gc0", "gc1", "gc2"]
    if brief:
        def med(xs):
            return statistics.median(xs) if xs else 0.0
        pl = [per[s] for s in plain]
        print(f"{name.split('/')[-1]}: ins {len(ins)} plain {len(plain)} | plain STEP {med([p['STEP'] for p in pl]):.2f} "
              f"async_eval {med([p['async_eval'] for p in pl]):.2f} fwd_build {med([p['fwd_build'] for p in pl]):.2f} "
              f"wait {med([p['wait'] for p in pl]):.2f} | "
              "after insertion STEP " + " ".join(f"{med([per[s + d]['STEP'] for s in ins]):.1f}" for d in range(5)))
        continue
    print(f"{name}: {len(ins)} insertions beside decoding rows, {len(plain)} plain steps")
    print(f"{'phase':20s} {'plain':>7s} " + " ".join(f"{'k+' + str(d):>7s}" for d in range(5)))
    for p in phases:
        pl = statistics.median(per[s][p] for s in plain) if plain else 0
        cols = [statistics.median(per[s + d][p] for s in ins) if ins else 0 for d in range(5)]
        mx_ = [max(per[s + d][p] for s in ins) if ins else 0 for d in range(5)]
        if max(cols + [pl] + mx_) < 0.05:
            continue
        print(f"{p:20s} {pl:7.2f} " + " ".join(f"{c:7.2f}" for c in cols)
              + "   max " + " ".join(f"{m:.1f}" for m in mx_))
