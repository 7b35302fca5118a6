"""Waves of N equal requests through the engine (no HTTP), each wave after the last one's end;
from the actor's step trace, the steps that emptied the batch (their tokens wait for them) and
the lines of a dry batch's rows leaving after the report (`settle_s` > 0, a tree that has them).

    python waves.py MODEL N [WAVES]   (with the working directory's trio_mlx)
"""
import csv
import os
import statistics
import sys
import tempfile

import trio

import trio_mlx

model, n = sys.argv[1], int(sys.argv[2])
waves = int(sys.argv[3]) if len(sys.argv) > 3 else 6
trace = os.path.join(tempfile.mkdtemp(), "trace.tsv")


async def main() -> None:
    async with trio_mlx.open_engine(model, step_trace=trace, max_batch=64, prefill_batch=n) as engine:
        for wave in range(waves):
            async def one(i: int, wave: int = wave) -> None:
                async with engine.generate(f"wave {wave} prompt number {i} " * 20, max_tokens=24,
                                           temperature=0, ignore_eos=True) as s:
                    async for _ in s:
                        pass
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)
            await trio.sleep(0.3)

trio.run(main)
rows = list(csv.DictReader(open(trace), delimiter="\t"))
plain = [float(r["next_s"]) for r in rows
         if r["rows"] != "0" and r["inserted"] == "0" and r["prompt_tokens"] == "0" and r["generated"] != "0"]
dry = [float(r["next_s"]) * 1e3 for r in rows if r["generated"] != "0" and r["live"] == "0" and r["inserted"] == "0"]
settles = [float(r["next_s"]) * 1e3 for r in rows if r["generated"] == "0" and float(r.get("settle_s", 0)) > 0]
print(f"plain step median {statistics.median(plain) * 1e3:.2f} ms; steps that emptied the batch (after the first wave) "
      f"{' '.join(f'{x:.1f}' for x in dry[1:])} ms; rows leaving after the report {' '.join(f'{x:.1f}' for x in settles[1:])} ms")
