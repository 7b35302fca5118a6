"""The steps that emptied the batch, and the settle lines after them, in step traces.

    python dry.py TRACE.tsv...   (e.g. the run*/levels.tsv in traces.tgz)

A step that emptied the batch: its next line is a settle line (`settle_s` > 0, nothing
generated). Prints, per trace, each such step's seconds (`next_s`) with its rows, and the
settle lines' `settle_s` (the wait for the device after the rows left).
"""
import csv
import sys

for path in sys.argv[1:]:
    rows = list(csv.DictReader(open(path), delimiter="\t"))
    dry, settles = [], []
    for before, line in zip(rows, rows[1:], strict=False):
        if float(line["settle_s"]) > 0 and line["generated"] == "0":
            dry.append(f"{float(before['next_s']) * 1e3:.1f} ms ({before['rows']} rows)")
            settles.append(float(line["settle_s"]) * 1e3)
    settles.sort()
    print(f"{path}: {len(dry)} steps that emptied the batch: {', '.join(dry)}")
    if settles:
        print(f"  settle_s: min {settles[0]:.1f}, median {settles[len(settles) // 2]:.1f}, max {settles[-1]:.1f} ms")
