"""Probe: the quantized KV cache (`kv_bits`) through the engine: decode speed and KV bytes per token.

    PYTHONPATH=. python benchmarks/probes/probe_kv_bits.py MODEL_DIR [--configs none,8,4]
        [--prompt-tokens 1024] [--max-tokens 256] [--levels 1,16] [--group-size 64] [--out F.json]

For each configuration (none: the model's own KV precision; 8, 4: `kv_bits`), one engine
(`trio_mlx.open_engine`) at a time: one greedy request alone whose finished sequence (prompt
and answer) the prompt cache stores, so that its bytes over its tokens are the KV bytes per
token as the cache holds them (quantized where `kv_bits` is set); then `--levels` of
concurrent greedy requests (distinct prompts: no prompt-cache hits), each row's decode speed
(tokens after the first over the time after the first) and the level's aggregate. Prints
one JSON line per configuration and level, with the device's memory and the memory MLX holds
once the model is loaded, so that the conversations that fit at a context length can be
stated: (device memory - active memory after load) / (context x KV bytes per token), e.g.
`fit_32k`. Three engines, each loaded and warmed up once (on CUDA the warm-up compiles the
quantized attention's kernels the first time), and about 20 requests each: meant to stay
within a few minutes for a 1B model on an H200.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import trio
from _timing import timed  # beside this file

import trio_mlx

# MLX is imported in the functions that read its figures, once the engine has loaded it: on
# Linux's CPU build `trio_mlx.models` must load OpenBLAS before MLX does (`models/_cpu_blas.py`).


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    """`n` ordinary token ids, distinct per `seed` from the first one on."""
    lo, span = 100, max(1, min(vocab, 32000) - 200)
    return [lo + (seed * 7919 + i * 104729) % span for i in range(n)]


async def one(engine: trio_mlx.Engine, prompt: list[int], max_tokens: int) -> dict:
    return await timed(engine.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def level(engine: trio_mlx.Engine, c: int, prompt_tokens: int, max_tokens: int, vocab: int) -> dict:
    got: list[dict] = []

    async def worker(i: int) -> None:
        got.append(await one(engine, prompt_ids(prompt_tokens, 1000 * c + i, vocab), max_tokens))

    async with trio.open_nursery() as nursery:
        for i in range(c):
            nursery.start_soon(worker, i)
    start, end = max(g["first"] for g in got), min(g["end"] for g in got)  # every row decoding
    return {"decode_tps_per_row": statistics.median(g["decode_tps"] for g in got),
            "decode_tps_total": sum(g["decode_tps"] for g in got) if end > start else None,
            "ttft_median": statistics.median(g["ttft"] for g in got),
            "errors": [g["error"] for g in got if g["error"]]}


def device_memory() -> int:
    import mlx.core as mx

    try:
        info = mx.device_info()
    except Exception:
        return 0
    return int(info.get("memory_size") or info.get("total_memory") or 0)


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--configs", default="none,8,4", help="none (the model's own precision) and kv_bits values")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--levels", default="1,16")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows: list[dict] = []
    total = 0
    for name in a.configs.split(","):
        bits = None if name == "none" else int(name)
        t0 = time.perf_counter()
        async with trio_mlx.open_engine(a.model, kv_bits=bits, kv_group_size=a.group_size) as engine:
            load_s = time.perf_counter() - t0
            import mlx.core as mx

            total = total or device_memory()
            loaded = mx.get_active_memory()  # the process's MLX allocator: the weights, warm-up freed
            vocab = engine.info.vocab_size if engine.info else 32000
            # the KV bytes per token, from the one entry the prompt cache holds after one request
            alone = await one(engine, prompt_ids(a.prompt_tokens, 1, vocab), a.max_tokens)
            s = engine.statistics()
            held = a.prompt_tokens + alone["tokens"]
            per_token = s.prompt_cache_bytes / held if s.prompt_cache_entries == 1 else None
            for c in (int(x) for x in a.levels.split(",")):
                got = await level(engine, c, a.prompt_tokens, a.max_tokens, vocab)
                free = total - loaded if total else None
                row = {"kv_bits": bits, "group_size": a.group_size if bits else None, "c": c, **got,
                       "kv_bytes_per_token": per_token, "cache_entries_after_first": s.prompt_cache_entries,
                       "device_memory": total, "active_after_load": loaded, "load_s": load_s,
                       "fit_32k": int(free // (32768 * per_token)) if free and per_token else None,
                       "fit_128k": int(free // (131072 * per_token)) if free and per_token else None,
                       "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens, "model": a.model}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))  # noqa: ASYNC240 - once, at the end


trio.run(main)
