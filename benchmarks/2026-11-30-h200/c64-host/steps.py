"""A server's step trace at full width: the decode steps with 56-64 rows live (no prompt
tokens, no entries), their median ms, by run and by chunk, and the steps that took prompts.

    python steps.py TRACE.tsv[.gz] [PROGRESS.txt]

PROGRESS.txt (`run.sh paired`) names each bench run's span on the trace's clock ("NAME from
T", "NAME to T"); without it the whole trace is one run. A chunk is a stretch of such steps
with no gap of over 0.3 s (a paired run's server chunks: the ceiling runs between them)."""

from __future__ import annotations

import csv
import gzip
import re
import statistics
import sys


def load(path: str) -> list[dict[str, str]]:
    f = gzip.open(path, "rt") if path.endswith(".gz") else open(path)
    return [r for r in csv.DictReader(f, delimiter="\t") if r["t"] != "t"]


def spans(path: str | None) -> dict[str, tuple[float, float]]:
    if path is None:
        return {"all": (0.0, float("inf"))}
    found: dict[str, list[float]] = {}
    for line in open(path):
        if m := re.match(r"(\S+) (from|to) ([\d.]+)$", line.strip()):
            found.setdefault(m[1], []).append(float(m[3]))
    return {k: (v[0], v[1]) for k, v in found.items() if len(v) == 2}


rows = load(sys.argv[1])
ts = [float(r["t"]) for r in rows]
for name, (a, b) in spans(sys.argv[2] if len(sys.argv) > 2 else None).items():
    full = [(ts[i], 1e3 * (ts[i + 1] - ts[i])) for i, r in enumerate(rows[:-1])
            if a <= ts[i] <= b and 56 <= int(r["live"]) <= 64 and r["prompt_tokens"] == "0"
            and r["inserted"] == "0" and ts[i + 1] - ts[i] < 1]
    prompts = [1e3 * (ts[i + 1] - ts[i]) for i, r in enumerate(rows[:-1])
               if a <= ts[i] <= b and r["prompt_tokens"] != "0" and ts[i + 1] - ts[i] < 1]
    if not full:
        print(f"{name}: no full-width decode steps")
        continue
    print(f"{name}: {len(full)} full-width decode steps, median {statistics.median(x for _, x in full):.2f} ms; "
          f"{len(prompts)} steps with prompts, median {statistics.median(prompts) if prompts else 0:.1f} ms, "
          f"{sum(prompts) / 1e3:.2f} s in all")
    chunks = [[full[0]]]
    for prev, cur in zip(full, full[1:], strict=False):
        if cur[0] - prev[0] > 0.3:
            chunks.append([])
        chunks[-1].append(cur)
    if len(chunks) > 1:
        for c in chunks:
            print(f"  chunk at {c[0][0]:.1f}: {len(c)} steps, median {statistics.median(x for _, x in c):.2f} ms")
