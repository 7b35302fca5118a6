"""The step traces of `run.sh ab` (`TRIO_MLX_STEP_TRACE`'s columns), request by request:
how many plain and speculative steps each measured request took, the seconds each kind
took in all, and the plain steps that follow a speculative one (not pipelined).

    python3 steps.py DIR    (the traces DIR/trace-TREE-rROUND-CONFIG-r0.tsv)
"""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path


def requests(path: Path) -> list[list[dict[str, str]]]:
    """The trace's steps split at each request's insertion; the first (the warm-up) dropped."""
    rows = [r for r in csv.DictReader(path.open(), delimiter="\t") if r["t"] != "t"]
    starts = [i for i, r in enumerate(rows) if int(r["inserted"]) > 0] + [len(rows)]
    return [rows[a:b] for a, b in zip(starts, starts[1:], strict=False)][1:]


def summary(steps: list[dict[str, str]]) -> dict[str, float]:
    kinds = []
    for s in steps:
        if int(s["drafted"]) > 0:
            kinds.append("S")
        elif int(s["generated"]) > 0 and int(s["inserted"]) == 0:
            kinds.append("p")
        else:
            kinds.append("-")
    secs = [float(s["next_s"]) + float(s["exchange_s"]) for s in steps]
    after = [t for k, prev, t in zip(kinds[1:], kinds, secs[1:], strict=False) if k == "p" and prev == "S"]
    plain = [t for k, prev, t in zip(kinds[1:], kinds, secs[1:], strict=False) if k == "p" and prev == "p"]
    spec = [t for k, t in zip(kinds, secs, strict=True) if k == "S"]
    return {"tokens": sum(int(s["generated"]) for s in steps), "steps": len(steps),
            "spec": len(spec), "plain": len(plain) + len(after), "after_spec": len(after),
            "s_spec": sum(spec), "s_plain": sum(plain), "s_after": sum(after), "s_all": sum(secs),
            "ms_spec": 1e3 * statistics.median(spec) if spec else 0.0,
            "ms_plain": 1e3 * statistics.median(plain) if plain else 0.0,
            "ms_after": 1e3 * statistics.median(after) if after else 0.0,
            "kept": sum(int(s["generated"]) - 1 for s in steps if int(s["drafted"]) > 0),
            "wasted": sum(1 for s in steps if int(s["drafted"]) > 0 and int(s["generated"]) == 1)}


def main() -> None:
    out = Path(sys.argv[1])
    print("trace\treq\ttokens\tsteps\tspec\tplain\tafter_spec\tspec_kept_none\tms_plain\tms_after\tms_spec"
          "\ts_plain\ts_after\ts_spec\ts_all")
    for path in sorted(out.glob("trace-*.tsv")):
        for i, req in enumerate(requests(path)):
            m = summary(req)
            print(f"{path.stem}\t{i}\t{m['tokens']}\t{m['steps']}\t{m['spec']}\t{m['plain']}\t{m['after_spec']}"
                  f"\t{m['wasted']}\t{m['ms_plain']:.2f}\t{m['ms_after']:.2f}\t{m['ms_spec']:.2f}\t{m['s_plain']:.3f}"
                  f"\t{m['s_after']:.3f}\t{m['s_spec']:.3f}\t{m['s_all']:.3f}")


if __name__ == "__main__":
    main()
