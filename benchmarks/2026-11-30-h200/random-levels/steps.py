"""The step traces of `run.sh rounds` level by level: each level's wall time and tokens, its
speculative steps (their seconds and the drafts they kept), its insertions (prompts entering,
into an idle batch or beside decoding rows) and its plain steps by width (the median ms).

    python3 steps.py DIR    (every DIR/*.tsv)

A trace holds the warm-up and then the levels in order; a level starts at the first step
with more sequences live than the level before it allowed (`live`)."""

from __future__ import annotations

import collections
import csv
import statistics
import sys
from pathlib import Path


def levels(rows: list[dict[str, str]]) -> list[tuple[int, list[dict[str, str]]]]:
    """(concurrency, steps) per level: the first step after the warm-up's burst with one
    sequence live starts c=1; each later level starts where `live` first exceeds the last."""
    start = next(i for i, r in enumerate(rows) if i > 0 and int(r["live"]) == 1 and int(r["inserted"]) > 0)
    out, top, begun = [], 1, start
    for i in range(start, len(rows)):
        live = int(rows[i]["live"])
        if live > top:
            out.append((top, rows[begun:i]))
            top, begun = live, i
    out.append((top, rows[begun:]))
    return out


def main() -> None:
    print("trace\tc\ttok/s\ttokens\ts\tspec\tspec_s\tkept\tinserts\tbeside\tinsert_s\tplain ms by width")
    for path in sorted(Path(sys.argv[1]).glob("*.tsv")):
        rows = [r for r in csv.DictReader(path.open(), delimiter="\t") if r["t"] != "t"]
        for c, seg in levels(rows):
            secs = [float(r["next_s"]) + float(r["exchange_s"]) for r in seg]
            wall = float(seg[-1]["t"]) - float(seg[0]["t"]) + secs[0]
            tokens = sum(int(r["generated"]) for r in seg)
            spec = [(s, r) for s, r in zip(secs, seg, strict=True) if int(r["drafted"]) > 0]
            ins = [(s, r, p) for s, r, p in zip(secs[1:], seg[1:], seg[:-1], strict=True) if int(r["inserted"]) > 0]
            plain: dict[int, list[float]] = collections.defaultdict(list)
            for s, r in zip(secs, seg, strict=True):
                if int(r["drafted"]) == 0 and int(r["inserted"]) == 0 and int(r["generated"]) > 0:
                    plain[int(r["rows"])].append(s)
            widths = " ".join(f"{w}:{1e3 * statistics.median(v):.2f}({len(v)})" for w, v in sorted(plain.items()))
            print(f"{path.name}\t{c}\t{tokens / wall:.0f}\t{tokens}\t{wall:.2f}\t{len(spec)}"
                  f"\t{sum(s for s, _ in spec):.3f}\t{sum(int(r['generated']) - int(r['rows']) for _, r in spec)}"
                  f"\t{len(ins)}\t{sum(1 for _, _, p in ins if int(p['rows']) > 0)}\t{sum(s for s, _, _ in ins):.3f}"
                  f"\t{widths}")


if __name__ == "__main__":
    main()
