"""The slowest steps of each step trace after its warm-up: where the one-time long step falls.

    python3 slow.py TRACE.tsv...

Per trace: the five slowest steps after the warm-up (exchange_s + next_s, with the step's
index from the first measured step, its live rows, the prompts it inserted and its actor
CPU seconds), and the median step."""

from __future__ import annotations

import csv
import statistics
import sys


def main() -> None:
    for path in sys.argv[1:]:
        rows = [r for r in csv.DictReader(open(path), delimiter="\t") if r["t"] != "t"]
        start = next((i for i, r in enumerate(rows) if i > 0 and int(r["live"]) == 1 and int(r["inserted"]) > 0), 0)
        seg = rows[start:]
        secs = [float(r["exchange_s"]) + float(r["next_s"]) for r in seg]
        top = sorted(range(len(seg)), key=lambda i: -secs[i])[:5]
        print(f"{path}: {len(seg)} steps, median {statistics.median(secs) * 1e3:.2f} ms; slowest:")
        for i in top:
            r = seg[i]
            print(f"  step {i}: {secs[i] * 1e3:.1f} ms, live {r['live']}, inserted {r['inserted']}, "
                  f"cpu {float(r['cpu_s']) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
