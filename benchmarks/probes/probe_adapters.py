"""Probe: what named LoRA adapters cost a batch, through the engine.

    PYTHONPATH=. python benchmarks/probes/probe_adapters.py MODEL_DIR [--rank 16] [--levels 1,16]
        [--max-tokens 128] [--rounds 2] [--out adapters.json]

MODEL_DIR: an MLX model directory (a random bf16 one will do: `trio-mlx model build DIR
--shape 1b --dtype bfloat16`). The probe makes two random LoRA adapters for it itself
(rank `--rank` on every linear layer of every block, as mlx_lm.lora's default targets, lora_b
small and random so that they change the output; in a child process), then, for each round, serves in turn:

- `plain`: an engine without adapters, every request on the model;
- `none`: an engine with both adapters loaded, every request on the model (what the
  multi-adapter layers cost rows that use none);
- `one`: the same engine, every request on adapter a;
- `mixed`: the same engine, requests on a, b and none in turn.

At each level c (concurrent requests, each a distinct prompt of ~64 tokens, greedy,
`--max-tokens` tokens, EOS ignored) it prints the output tokens per second of the whole
level (every request's tokens over the level's wall time) and the median decode tok/s of
one request (tokens after its first over the time after its first), then each
configuration's ratio to `plain`: of the medians, and the median of each round's own ratio
(paired by round, which a host's drift between rounds does not move). The two engines alternate order by round (BENCHMARKS.md,
"Method": a host's speed drifts). One engine at a time: engines of one process share the
device's one actor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from _timing import timed  # beside this file

import trio_mlx


def make_adapters(model_dir: str, where: Path, rank: int) -> dict[str, str]:
    """Two random LoRA adapters for `model_dir`, as mlx_lm.lora writes them."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map_with_path
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    out = {}
    for seed, name in enumerate(("a", "b")):
        model, _ = load_model(Path(model_dir))
        model.freeze()
        params = {"rank": rank, "dropout": 0.0, "scale": 2.0}
        linear_to_lora_layers(model, len(model.layers), params)
        mx.random.seed(100 + seed)
        model.update(tree_map_with_path(
            lambda n, w: (mx.random.normal(w.shape) * 0.01).astype(w.dtype) if n.endswith("lora_b") else w,
            model.trainable_parameters()))
        d = where / name
        d.mkdir(parents=True)
        mx.save_safetensors(str(d / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
        (d / "adapter_config.json").write_text(json.dumps(
            {"fine_tune_type": "lora", "num_layers": len(model.layers), "lora_parameters": params}))
        out[name] = str(d)
        del model
    return out


_counter = iter(range(10**9))


def prompt() -> str:
    """A prompt no earlier request shares (no prompt cache hits between levels or rounds)."""
    k = next(_counter)
    return f"Request {k}. " + " ".join(f"w{(k * 31 + i) % 997}" for i in range(40))


async def one(engine: Any, adapter: str | None, max_tokens: int) -> dict[str, Any]:
    return await timed(engine.generate(prompt(), max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                       adapter=adapter))


async def level(engine: Any, adapters: list[str | None], c: int, max_tokens: int) -> dict[str, float]:
    rows: list[dict[str, float]] = []

    async def worker(i: int) -> None:
        rows.append(await one(engine, adapters[i % len(adapters)], max_tokens))

    t0 = time.perf_counter()
    async with trio.open_nursery() as n:
        for i in range(c):
            n.start_soon(worker, i)
    wall = time.perf_counter() - t0
    return {"tok_s": sum(r["tokens"] for r in rows) / wall,
            "decode_tps_p50": statistics.median(r["decode_tps"] for r in rows),
            "ttft_p50": statistics.median(r["ttft"] for r in rows)}


CONFIGS: dict[str, tuple[bool, list[str | None]]] = {
    "plain": (False, [None]), "none": (True, [None]), "one": (True, ["a"]), "mixed": (True, ["a", "b", None]),
}


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--levels", default="1,16")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="adapters.json")
    a = p.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    results: dict[str, dict[int, list[dict[str, float]]]] = {k: {c: [] for c in levels} for k in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        # In a child process: making them in this one (mlx_lm's loader and tuner on this
        # process's threads) left the engines that followed far slower on the CPU; the cause
        # was not found, and a child keeps the measured process as a server's.
        await trio.to_thread.run_sync(lambda: subprocess.run(
            [sys.executable, __file__, "--make", a.model, tmp, str(a.rank)], check=True))
        adapters = {name: str(Path(tmp) / name) for name in ("a", "b")}
        print(f"made 2 adapters of rank {a.rank} in {time.perf_counter() - t0:.1f} s", flush=True)
        for r in range(a.rounds):
            order = [False, True] if r % 2 == 0 else [True, False]
            for with_adapters in order:
                opts: dict[str, Any] = {"adapters": adapters} if with_adapters else {}
                t0 = time.perf_counter()
                async with trio_mlx.open_engine(a.model, max_batch=max(levels), **opts) as engine:
                    print(f"round {r}: engine {'with' if with_adapters else 'without'} adapters ready in "
                          f"{time.perf_counter() - t0:.1f} s", flush=True)
                    for name, (needs, which) in CONFIGS.items():
                        if needs != with_adapters:
                            continue
                        for c in levels:
                            await level(engine, which, c, 8)  # warm this level's shapes
                            got = await level(engine, which, c, a.max_tokens)
                            results[name][c].append(got)
                            print(f"  {name:6s} c={c:<3d} {got['tok_s']:8.1f} tok/s  decode p50 "
                                  f"{got['decode_tps_p50']:7.1f} tok/s  ttft p50 {got['ttft_p50'] * 1e3:6.0f} ms",
                                  flush=True)
    print("\nmedian over rounds (ratio to plain):")
    summary: dict[str, dict[int, float]] = {}
    for name in CONFIGS:
        summary[name] = {c: statistics.median(x["tok_s"] for x in results[name][c]) for c in levels}
    paired: dict[str, dict[int, float]] = {}  # each round's ratio to that round's plain, median
    for name in CONFIGS:
        paired[name] = {c: statistics.median(x["tok_s"] / p["tok_s"] for x, p in
                                             zip(results[name][c], results["plain"][c], strict=True)) for c in levels}
        cells = "  ".join(f"c={c}: {summary[name][c]:8.1f} tok/s ({summary[name][c] / summary['plain'][c]:.3f}; "
                          f"paired by round {paired[name][c]:.3f})" for c in levels)
        print(f"  {name:6s} {cells}")
    await trio.Path(a.out).write_text(json.dumps({"args": vars(a), "results": results, "median_tok_s": summary, "paired_ratio": paired}, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make"]:
        make_adapters(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
    else:
        trio.run(main)
