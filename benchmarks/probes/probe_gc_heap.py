"""Probe: what a full collection of Python's cyclic garbage collector walks in a started engine.

    python benchmarks/probes/probe_gc_heap.py MODEL_DIR [--actor thread|process]

Opens the engine on MODEL_DIR (startup freezes what it loaded: `trio_mlx/_heap.py`), serves
64 random 128-token prompts, then prints the objects the collector tracks and the median
time of a full collection (`gc.collect()`) over 5, first as the engine left the heap, then
with the heap thawed (every object tracked, as before the freeze). A full collection holds
the GIL: the event loop and the thread actor stop for as long.
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import trio

import trio_mlx


def collect_ms(n: int = 5) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


async def main(args: argparse.Namespace) -> None:
    async with trio_mlx.open_engine(args.model, actor=args.actor, max_batch=64) as engine:
        vocab = engine.info.vocab_size if engine.info else 512
        rng = random.Random(0)

        async def one() -> None:
            prompt = [rng.randrange(5, min(vocab, 500)) for _ in range(128)]
            async with engine.generate(prompt, max_tokens=16, temperature=0, ignore_eos=True) as events:
                async for _ in events:
                    pass

        async with trio.open_nursery() as nursery:
            for _ in range(64):
                nursery.start_soon(one)
        print(f"frozen at startup: {gc.get_freeze_count():,} objects; tracked: {len(gc.get_objects()):,}; "
              f"a full collection: {collect_ms():.1f} ms")
        gc.unfreeze()
        print(f"thawed: tracked {len(gc.get_objects()):,}; a full collection: {collect_ms():.1f} ms")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--actor", default="thread", choices=["thread", "process"])
    trio.run(main, p.parse_args())
