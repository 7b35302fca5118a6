"""Four users in a closed loop on random word prompts (32 requests, 128 tokens, greedy), in process: tok/s, TTFT p50, tokens drafted and kept. usage: python probe.py MODEL REQUESTS ngram|off"""
import random
import statistics
import sys
import time

import trio

import trio_mlx
import trio_mlx.models  # noqa: F401  # OpenBLAS before MLX (importing trio_mlx alone loads no MLX)

MODEL, N, C = sys.argv[1], int(sys.argv[2]), 4
spec = sys.argv[3] if len(sys.argv) > 3 else "ngram"

async def main():
    rng = random.Random(0)
    words = "alpha beta gamma delta river stone cloud light table green seven north paper ocean metal quiet".split()
    prompts = [" ".join(rng.choice(words) for _ in range(24)) for _ in range(N)]
    ttfts, toks, drafted, kept = [], 0, 0, 0
    opts = {} if spec == "off" else {"speculative": spec}
    async with trio_mlx.open_engine(MODEL, max_batch=C, **opts) as engine:
        it = iter(prompts)
        t0 = time.perf_counter()
        async def client():
            nonlocal toks, drafted, kept
            for p in it:
                s, first = time.perf_counter(), None
                async with engine.generate(p, max_tokens=128, temperature=0, ignore_eos=True) as st:
                    async for ev in st:
                        if first is None and isinstance(ev, trio_mlx.TextDelta):
                            first = time.perf_counter() - s
                        if isinstance(ev, trio_mlx.Finished):
                            u = ev.usage
                            toks += u.completion_tokens
                            drafted += u.draft_tokens
                            kept += u.accepted_draft_tokens
                ttfts.append(first)
        async with trio.open_nursery() as n:
            for _ in range(C):
                n.start_soon(client)
        wall = time.perf_counter() - t0
    print(f"{spec}: {toks / wall:.0f} tok/s ttft p50 {statistics.median(ttfts) * 1e3:.1f} ms drafted {drafted} kept {kept}")

trio.run(main)
