"""Probe (GPU investigation): what a running server's first requests of each kind make MLX compile.

    MLX_PTX_CACHE_DIR=$(mktemp -d) trio-mlx serve --model M --port 8811 &
    MLX_PTX_CACHE_DIR=<the same> python benchmarks/probes/probe_first_requests.py http://127.0.0.1:8811

Once the server is ready (its warm-up done), sends one kind of request after
another, each twice (alone, then again), 16 tokens of a 128-token prompt:
greedy, each sampling option, penalties, logit bias, logprobs, a seeded
request, prompts of other lengths, and a burst of mixed kinds at once. For
each it prints the wall time of both tries and the kernel modules MLX
compiled meanwhile: MLX writes every module it compiles to its PTX cache, so
with the server started on an empty one, a module that appears here was
compiled after the server reported ready, in someone's request (on CUDA
that takes seconds: benchmarks/2026-11-23-h100/warmup/README.md). The server's warm-up should
leave nothing to compile.
"""
import os
import random
import sys
import time

import httpx
import trio

url = sys.argv[1].rstrip("/")
ptx = os.environ.get("MLX_PTX_CACHE_DIR", "")
rng = random.Random(0)


def modules() -> set[str]:
    return {f[:-4] for f in os.listdir(ptx) if f.endswith(".ptx")} if os.path.isdir(ptx) else set()


def prompt(n: int) -> list[int]:
    return [rng.randrange(10, 400) for _ in range(n)]


KINDS: list[tuple[str, dict]] = [
    ("greedy", {"temperature": 0}),
    ("temperature", {"temperature": 0.7}),
    ("top_p", {"temperature": 0.7, "top_p": 0.9}),
    ("top_k", {"temperature": 0.7, "top_k": 40}),
    ("min_p", {"temperature": 0.7, "min_p": 0.05}),
    ("seed", {"temperature": 0.7, "seed": 1}),
    ("repetition_penalty", {"temperature": 0, "repetition_penalty": 1.1}),
    ("presence+frequency", {"temperature": 0, "presence_penalty": 0.5, "frequency_penalty": 0.5}),
    ("logit_bias", {"temperature": 0, "logit_bias": {"11": 2.0}}),
    ("logprobs 5", {"temperature": 0, "logprobs": 5}),
    ("n=2", {"temperature": 0.7, "n": 2}),
]
LENGTHS = [1, 20, 500, 2000]


errors: list[str] = []


async def one(client: httpx.AsyncClient, body: dict) -> None:
    r = await client.post(f"{url}/v1/completions", json={"max_tokens": 16, "ignore_eos": True, **body})
    if r.status_code != 200:
        errors.append(f"{r.status_code} {r.text[:200]}")


async def main() -> None:
    seen = modules()
    print(f"{len(seen)} modules compiled before the first request (warm-up)", flush=True)
    async with httpx.AsyncClient(timeout=600) as client:
        cases = [(k, lambda b=b: one(client, {"prompt": prompt(128), **b})) for k, b in KINDS]
        cases += [(f"prompt {n}", lambda n=n: one(client, {"prompt": prompt(n), "temperature": 0}))
                  for n in LENGTHS]

        async def burst() -> None:
            async with trio.open_nursery() as nursery:
                for i in range(12):
                    _, body = KINDS[i % len(KINDS)]
                    nursery.start_soon(one, client, {"prompt": prompt(64 + 16 * i), **body})

        cases.append(("burst of 12 mixed", burst))
        for name, case in cases:
            times = []
            for _ in range(2):
                t = time.perf_counter()
                await case()
                times.append(time.perf_counter() - t)
            now = modules()
            new = sorted(now - seen)
            seen |= now
            failed = f"; errors: {errors}" if errors else ""
            errors.clear()
            print(f"{name}: {times[0] * 1000:.0f} ms, again {times[1] * 1000:.0f} ms; compiled: {new}{failed}",
                  flush=True)


trio.run(main)
