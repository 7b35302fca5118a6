"""The README's tables from the runs' JSON: tok/s and TTFT p50 per level, each configuration
against off (a run's configuration is its file name between `rN-` or `fN-cN-` and `.json`, less a
`-cN`).
usage: python table.py (from this folder)"""

import collections
import glob
import json
import os
import re
import statistics as st

for sub in ("a-0210059", "b-7191545", "c-width", "d-readbacks", "e-read-three", "g-varied-lengths"):
    acc = collections.defaultdict(lambda: collections.defaultdict(list))
    for f in sorted(glob.glob(f"{sub}/[rf]*.json")):
        cfg = re.sub(r"^[rf]\d+-(c\d+-)?|-c\d+$", "", os.path.basename(f)[: -len(".json")])
        for lv in json.load(open(f))["levels"]:
            acc[lv["concurrency"]][cfg].append((lv["output_throughput"], lv["ttft_ms"]["p50"]))
    for c in sorted(acc):
        o = acc[c]["off"]
        for cfg, n in sorted(acc[c].items()):
            if cfg == "off" or not o:
                continue
            ratio = st.mean(x[0] for x in n) / st.mean(x[0] for x in o)
            print(f"| {sub} | {c} | {cfg} | {', '.join(str(round(x[0])) for x in o)} | {', '.join(str(round(x[0])) for x in n)} "
                  f"| {ratio:.2f}x | {', '.join(str(round(x[1])) for x in o)} | {', '.join(str(round(x[1])) for x in n)} |")
