"""probe_grammar_engine.py's `PHASES` file: the constrained steps at 64 rows in four quartiles by
how long their budget checks took, with the median of each part in each quartile (what the
checks cost the step, and what the step costs without them).

    python3 quartiles.py PHASES.tsv
"""

from __future__ import annotations

import bisect
import statistics
import sys


def main() -> None:
    calls = [(th, n, float(a), float(b)) for th, n, a, b in
             (line.rstrip("\n").split("\t") for line in open(sys.argv[1]))]
    steps = sorted((a, b) for th, n, a, b in calls if n == "owned_step:64")
    others = sorted((a, b, th, n) for th, n, a, b in calls if not n.startswith("owned_step"))
    starts = [o[0] for o in others]
    rows = []
    for a, b in steps:
        inside = others[bisect.bisect_left(starts, a):bisect.bisect_right(starts, b)]
        if not any(n == "fill_masks" for *_, n in inside):
            continue
        evals = [(s, e) for s, e, th, n in inside if n == "async_eval"]
        checks = [(s, e) for s, e, th, n in inside if n == "measure"]
        fills = [(s, e) for s, e, th, n in inside if n == "fill_masks"]
        if not evals:
            continue
        fs, fe = evals[0]
        beside = sum(max(0.0, min(fe, e) - max(fs, s)) for s, e in checks)
        rows.append((fe - fs, sum(e - s for s, e in checks), beside, b - a, sum(e - s for s, e in fills)))
    rows.sort(key=lambda r: r[1])
    n = len(rows)
    for q in range(4):
        part = rows[q * n // 4:(q + 1) * n // 4]
        m = [statistics.median(r[i] for r in part) * 1e3 for i in range(5)]
        print(f"checks quartile {q}: checks {m[1]:.2f} ms ({m[2]:.2f} beside the forward's async_eval), "
              f"the forward's async_eval {m[0]:.2f}, the masks' fill {m[4]:.2f}, whole step {m[3]:.2f}")


if __name__ == "__main__":
    main()
