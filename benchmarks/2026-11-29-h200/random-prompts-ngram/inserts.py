"""The steps around each insertion in a step trace: the median time of the insertion's step
and the three after it, for prompts entering beside decoding rows and into an idle batch,
beside the median plain step. `python inserts.py TRACE.tsv ...` (e.g. g-varied-lengths/t2-*.tsv)."""

import csv
import statistics
import sys

for name in sys.argv[1:]:
    with open(name) as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    ts = [float(r["t"]) for r in rows]
    dts = [0.0] + [(b - a) * 1e3 for a, b in zip(ts, ts[1:], strict=False)]  # dts[i]: step i's ms

    beside: list[list[float]] = []
    idle: list[list[float]] = []
    for i, r in enumerate(rows):
        if i < 2 or i + 4 >= len(rows) or r["inserted"] == "0":
            continue
        (idle if rows[i - 1]["rows"] == "0" else beside).append(dts[i : i + 4])
    plain = statistics.median(dts[i] for i in range(2, len(rows))
                              if rows[i]["inserted"] == "0" and rows[i - 1]["inserted"] == "0")

    def medians(runs: list[list[float]]) -> str:
        return " ".join(f"{statistics.median(x[k] for x in runs):.1f}" for k in range(4)) if runs else "-"

    print(f"{name}: plain {plain:.1f} ms; beside decoding rows ({len(beside)}): {medians(beside)}; "
          f"into an idle batch ({len(idle)}): {medians(idle)}")
