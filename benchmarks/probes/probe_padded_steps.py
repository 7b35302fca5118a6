"""Probe (any device): how many of an engine's one-token attentions carry an array mask (rows
left-padded), with requests that end together or apart.

    python benchmarks/probes/probe_padded_steps.py MODEL_DIR [--spread 0,0.5] [--users 4]
        [--requests 4] [--max-tokens 48]

Each of `users` clients sends `requests` requests in turn (the same 40-token prompt, greedy,
`ignore_eos`), each's max_tokens drawn from MAX_TOKENS x [1 - spread, 1 + spread] as `trio-mlx
bench --max-tokens-spread` draws them. MLX's fused attention is wrapped to count the calls
with one query, with and without an array mask: on CUDA the masked ones are
`_cuda_attention`'s (docs/design.md).
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import trio

import trio_mlx


def count(model: Path, spread: float, users: int, requests: int, max_tokens: int) -> dict[str, int]:
    counts = {"masked": 0, "unmasked": 0}
    sdpa = mx.fast.scaled_dot_product_attention

    def counting(q: Any, k: Any, v: Any, *, scale: float, mask: Any = None, **kw: Any) -> Any:
        if q.shape[2] == 1:
            counts["masked" if isinstance(mask, mx.array) else "unmasked"] += 1
        return sdpa(q, k, v, scale=scale, mask=mask, **kw)

    async def main() -> None:
        rng = random.Random(0)
        async with trio_mlx.open_engine(model, warmup=False) as engine:
            async def user() -> None:
                for _ in range(requests):
                    n = max(1, round(max_tokens * (1 + spread * (2 * rng.random() - 1))))
                    async with engine.generate("hello world " * 20, max_tokens=n, temperature=0.0,
                                               ignore_eos=True) as events:
                        async for _ in events:
                            pass

            async with trio.open_nursery() as nursery:
                for _ in range(users):
                    nursery.start_soon(user)

    mx.fast.scaled_dot_product_attention = counting
    try:
        trio.run(main)
    finally:
        mx.fast.scaled_dot_product_attention = sdpa
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--spread", default="0,0.5")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args()
    for spread in (float(s) for s in args.spread.split(",")):
        c = count(args.model, spread, args.users, args.requests, args.max_tokens)
        total = c["masked"] + c["unmasked"]
        print(f"spread {spread}: {c['masked']} of {total} one-token attentions masked", flush=True)


if __name__ == "__main__":
    main()
