"""One line per level of `trio-mlx bench --out` JSON files: output tok/s, TTFT and TPOT medians."""

import json
import sys

for name in sys.argv[1:]:
    try:
        with open(name) as f:
            data = json.load(f)
    except Exception as exc:
        print(name, "missing", exc)
        continue
    for lv in data["levels"]:
        tpot, ttft = lv.get("tpot_ms") or {}, lv.get("ttft_ms") or {}
        print(name.split("/")[-1], lv.get("ceiling", "srv"), f"c={lv['concurrency']}",
              f"out {lv['output_throughput']:.0f} tok/s", f"ttft p50 {ttft.get('p50', 0):.1f}",
              f"tpot p50 {tpot.get('p50') or 0:.2f} ms", f"done {lv.get('completed')}/{lv.get('requests')}", flush=True)
