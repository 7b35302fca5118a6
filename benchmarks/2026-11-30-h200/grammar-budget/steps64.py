"""The step traces of probe_grammar_engine.py's runs, batch by batch: each batch's steps, its
seconds, and the median (p10, p90) of its steps at the full width of 64 rows with nothing
entering, with the stepping thread's CPU beside (as the trace's `cpu_s`).

    python3 steps64.py TRACE.tsv ...

A batch starts at a step that inserts prompts while at most one row was live before it. A run
holds, in order: the warm-up batch (constrained), free rows to max_tokens, then per round the
constrained batch and the free batch of the same token counts (the order alternates by round)."""

from __future__ import annotations

import csv
import statistics
import sys


def batches(path: str) -> list[list[dict[str, str]]]:
    rows = [r for r in csv.DictReader(open(path), delimiter="\t") if r["t"] != "t"]
    out: list[list[dict[str, str]]] = []
    cur: list[dict[str, str]] = []
    low = True
    for r in rows:
        if int(r["inserted"]) > 0 and low and cur:
            out.append(cur)
            cur = []
        low = int(r["live"]) - int(r["inserted"]) <= 1
        cur.append(r)
    out.append(cur)
    return out


def main() -> None:
    for path in sys.argv[1:]:
        print(path)
        for b in batches(path):
            full = [r for r in b if int(r["rows"]) == 64 and r["inserted"] == "0" and r["prompt_tokens"] == "0"]
            if len(full) < 5:
                continue
            ms = sorted(float(r["next_s"]) * 1e3 for r in full)
            cpu = statistics.median(float(r["cpu_s"]) * 1e3 for r in full)
            print(f"  {len(b)} steps, {float(b[-1]['t']) - float(b[0]['t']):.2f} s; at 64 rows: {len(full)} steps, "
                  f"median {statistics.median(ms):.2f} ms (p10 {ms[len(ms) // 10]:.2f}, p90 {ms[len(ms) * 9 // 10]:.2f}), "
                  f"CPU {cpu:.2f} ms, {sum(int(r['generated']) for r in b)} tokens")


if __name__ == "__main__":
    main()
