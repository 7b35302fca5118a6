"""The step traces of d-readbacks/ and e-read-three/: per trace, the median plain step of four
rows (no insertion in it or the step before, one token a row), the insertions, and the steps
over 15 ms with the seconds they took. `python steps.py [TRACE.tsv ...]` (default: every trace here)."""

import csv
import glob
import statistics
import sys

for name in sys.argv[1:] or sorted(glob.glob("*/t*.tsv")):
    with open(name) as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    ts = [float(r["t"]) for r in rows]
    dts = [ts[i] - ts[i - 1] for i in range(1, len(ts))]
    plain = [dts[i - 1] for i in range(1, len(rows))
             if rows[i]["inserted"] == "0" and rows[i - 1]["inserted"] == "0" and rows[i]["rows"] == "4"
             and int(rows[i]["generated"]) <= 4]
    inserted = sum(1 for r in rows if r["inserted"] != "0")
    slow = [d for d in dts if d > 0.015]
    print(f"{name}: {len(rows)} steps, plain p50 {statistics.median(plain) * 1e3:.2f} ms, {inserted} insertions, "
          f"{len(slow)} steps > 15 ms ({sum(slow):.2f} s), {ts[-1] - ts[0]:.2f} s in all")
