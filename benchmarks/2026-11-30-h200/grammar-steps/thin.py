"""probe_grammar_engine.py's step traces, batch by batch (../grammar-budget/steps64.py's split):
tokens/s over the batch, and apart over its steps at the full width of 64 rows and over its
thinning tail (fewer rows, nothing entering), with the median step, the actor thread's CPU
over it (`cpu_s`) and the exchange.

    python3 thin.py TRACE.tsv ...
"""

from __future__ import annotations

import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "grammar-budget"))
from steps64 import batches  # noqa: E402


def part(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "-"
    secs = sum(float(r["next_s"]) + float(r["exchange_s"]) for r in rows)
    tokens = sum(int(r["generated"]) for r in rows)
    def med(col: str) -> float:
        return statistics.median(float(r[col]) * 1e3 for r in rows)
    width = statistics.median(int(r["rows"]) for r in rows)
    return (f"{len(rows)} steps {tokens / secs:.0f} tok/s, step {med('next_s'):.2f} ms, cpu {med('cpu_s'):.2f}, "
            f"exchange {med('exchange_s'):.2f}, rows {width:.0f}")


def main() -> None:
    for path in sys.argv[1:]:
        print(path)
        for k, b in enumerate(batches(path)):
            if len(b) < 50:
                continue
            plain = [r for r in b if r["inserted"] == "0" and r["prompt_tokens"] == "0" and int(r["live"]) > 0]
            full = [r for r in plain if int(r["rows"]) == 64]
            thin = [r for r in plain if int(r["rows"]) < 64]
            secs = sum(float(r["next_s"]) + float(r["exchange_s"]) for r in b)
            tokens = sum(int(r["generated"]) for r in b)
            print(f"  batch {k}: {len(b)} steps, {secs:.2f} s, {tokens / secs:.0f} tok/s")
            print(f"    full width: {part(full)}")
            print(f"    thinning:   {part(thin)}")


if __name__ == "__main__":
    main()
