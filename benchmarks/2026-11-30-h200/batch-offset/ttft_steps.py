"""A lone user's time to first token, step by step: each c=1 request of `run.sh levels`'s trace
(`levels.tgz`'s levels.tsv, the actor's steps; `levels-requests.tsv.gz`, the server's requests, on
the same clock) with the two steps that follow its arrival: the prefill of all but its prompt's
last token, then the step that feeds that token and samples (and reads) the first one.

    python ttft_steps.py levels.tsv levels-requests.tsv.gz
"""

import csv
import gzip
import statistics
import sys

steps = [{k: float(v) for k, v in s.items()} for s in csv.DictReader(open(sys.argv[1]), delimiter="\t")]
reqs = list(csv.DictReader(gzip.open(sys.argv[2], "rt"), delimiter="\t"))
lone = [r for r in reqs if r["completion_tokens"] == "128"][:12]  # the c=1 level comes first
cols = ("intake", "prefill step", "prompt tokens", "last-token step", "its end", "first token")
print(" ".join(f"{c:>15s}" for c in cols))
rows = []
for r in lone:
    a = float(r["arrived"])
    prefill, last = [s for s in steps if s["t"] > a][:2]
    row = (1e3 * float(r["intake_s"]), 1e3 * prefill["next_s"], prefill["prompt_tokens"], 1e3 * last["next_s"],
           1e3 * (last["t"] + last["next_s"] - a), 1e3 * float(r["ttft_s"]))
    rows.append(row)
    print(" ".join(f"{v:15.2f}" for v in row))
print("medians", " ".join(f"{statistics.median(x[i] for x in rows):.2f}" for i in range(len(cols))))
