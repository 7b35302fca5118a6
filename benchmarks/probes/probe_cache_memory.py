"""Probe (CPU): MLX memory in use, idle, against what the prompt cache says it holds.

    PYTHONPATH=. python benchmarks/probes/probe_cache_memory.py MODEL [--concurrency 16]
        [--rounds 3] [--requests 100] [--seed 0] [--buffer-cache-off]

An engine on MODEL (a thread actor; the soak's tiny model: `trio-mlx model build DIR`),
requests of random words (5-200 of them, 5-60 new tokens, half chats, half completions),
`--concurrency` at a time. After a warm-up burst and after each round, idle: MLX's
memory in use, the prompt cache's counted bytes (`PromptCache.nbytes`), its entries, and
the sum of the entries' arrays' bytes; then "active - counted", which the soak
(tests/soak.py) holds to its warm-up level within 1 MiB. Last, the cache is emptied on
this thread (the actor idle) and the figures read again: what "active - counted" kept
above the warm-up is then either back (the cache held it) or not (something else did).

Each reading also takes a census of the entries' arrays: MLX's CPU allocator writes the
size it counts for a buffer in the 8 bytes before the buffer's data
(mlx/backend/no_gpu/allocator.cpp), so each array's header against its `nbytes`, and the
sum of the differences: the bytes that entries hold beyond what they count. `--buffer-cache-off`:
the engine with MLX's buffer cache bounded at 0 (`cache_limit_gb=0`), so that no array gets
a reused, larger block. CPU only (the header is the CPU allocator's).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import random

import mlx.core as mx
import numpy as np
import trio

import trio_mlx
from trio_mlx.actor._actor import Actor

WORDS = "the quick brown fox jumps over lazy dog once upon a time in beginning soak test".split()


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--buffer-cache-off", action="store_true")
    a = p.parse_args()
    rng = random.Random(a.seed)
    held: list[Actor] = []

    def make(config, link):  # the engine's actor, kept to read its cache
        actor = Actor(config, link)
        held.append(actor)
        return actor

    limit = {"cache_limit_gb": 0.0} if a.buffer_cache_off else {}
    async with trio_mlx.open_engine(a.model, actor=make, **limit) as engine:
        actor = held[0]

        async def one() -> None:
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 200)))
            options = trio_mlx.GenerationOptions(max_tokens=rng.randint(5, 60))
            if rng.random() < 0.5:
                stream = engine.chat([{"role": "user", "content": prompt}], options)
            else:
                stream = engine.generate(prompt, options)
            async with stream as events:
                async for _ in events:
                    pass

        async def burst(n: int) -> None:
            limit = trio.CapacityLimiter(a.concurrency)

            async def worker() -> None:
                async with limit:
                    await one()

            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    nursery.start_soon(worker)
            await trio.sleep(1.5)  # the batch runs dry, retired rows stored

        def show(label: str) -> None:
            cache = actor._reuse.cache
            arrays = sum(kv.nbytes for e in cache._lru.values() for kv in e.layers)
            active = mx.get_active_memory()
            print(f"{label:8s} active {active:>11,}  counted {cache.nbytes:>11,}  entries {len(cache._lru):4d}  "
                  f"arrays {arrays:>11,}  active - counted {active - cache.nbytes:>9,}", flush=True)
            over, larger, shapes = 0, 0, collections.Counter()
            for e in cache._lru.values():
                for kv in e.layers:
                    for arr in (kv.keys, kv.values):
                        ptr = np.frombuffer(memoryview(arr), dtype=np.uint8).ctypes.data
                        header = ctypes.c_size_t.from_address(ptr - 8).value  # the allocator's count
                        if header != arr.nbytes:
                            over, larger = over + header - arr.nbytes, larger + 1
                            shapes[(header, arr.nbytes)] += 1
            print(f"{'':8s} arrays in larger blocks {larger}, their extra bytes {over:,}; "
                  f"(block, nbytes) e.g. {shapes.most_common(3)}", flush=True)

        await burst(20)
        show("warm")
        for r in range(a.rounds):
            await burst(a.requests)
            show(f"round {r + 1}")
        actor._reuse.cache.clear()
        gc.collect()
        await trio.sleep(0.5)
        show("emptied")


trio.run(main)
