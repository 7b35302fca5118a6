"""The README's table from the runs' JSON: tok/s and TTFT p50 per level, off against ngram.
usage: python table.py (from this folder)"""

import collections
import glob
import json
import os
import statistics as st

for sub in ("a-0210059", "b-7191545", "c-width"):
    acc = collections.defaultdict(lambda: collections.defaultdict(list))
    for f in sorted(glob.glob(f"{sub}/*.json")):
        cfg = "ngram" if "ngram" in os.path.basename(f) else "off"
        for lv in json.load(open(f))["levels"]:
            acc[lv["concurrency"]][cfg].append((lv["output_throughput"], lv["ttft_ms"]["p50"]))
    for c in sorted(acc):
        o, n = acc[c]["off"], acc[c]["ngram"]
        ratio = st.mean(x[0] for x in n) / st.mean(x[0] for x in o)
        print(f"| {sub} | {c} | {', '.join(str(round(x[0])) for x in o)} | {', '.join(str(round(x[0])) for x in n)} "
              f"| {ratio:.2f}x | {', '.join(str(round(x[1])) for x in o)} | {', '.join(str(round(x[1])) for x in n)} |")
