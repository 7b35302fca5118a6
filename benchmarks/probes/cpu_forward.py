"""The embedded default's prompt and decode steps on the CPU, in tokens per CPU second.

    python benchmarks/probes/cpu_forward.py [--packed] [--prompt 128] [--steps 32]
        [--rounds 3] [--variants stock,blocks,blocks+norm,served]

A 128-token prompt, then greedy one-token steps, through mlx-lm's
BatchGenerator as the actor drives it, with whatever BLAS `trio_mlx.models`
loaded (TRIO_MLX_CPU_BLAS=reference for the wheel's own); the float32
(dequantized) variant unless --packed. Each variant is the model loaded one
way, all alternated in every round: `served` as the server loads it
(`models.load_model`), `stock` by mlx_lm alone, or a `+`-joined subset of
`models/_cpu_decode.py`'s swaps on mlx_lm's model (`blocks`: one-row matmuls
in row blocks; `norm`: compiled RMSNorm; `rope`: one-token RoPE). Per CPU
second figures stand in for an idle machine's on a shared one: the work is
one BLAS thread's (plus MLX's scheduling and Python's graph building), so
tokens per CPU second is about what an idle core does; wall figures are
printed too (on 2 idle cores they run ahead of the CPU figures: Python builds
the next step's graph while MLX computes this one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from trio_mlx import models

SWAPS = ("blocks", "norm", "rope")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--packed", action="store_true", help="the 4-bit variant")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="served", help="comma-separated; see the docstring")
    a = p.parse_args()
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load_model as mlx_load_model

    from trio_mlx.models import _cpu_decode as cd

    path = models.ensure_embedded_model(dequantize=not a.packed)
    classes: dict[str, dict[type, type]] = {
        "blocks": {nn.Linear: cd.RowBlockLinear, nn.Embedding: cd.RowBlockEmbedding},
        "norm": {nn.RMSNorm: cd.CompiledRMSNorm}, "rope": {nn.RoPE: cd.DecodeRoPE},
    }

    def load(variant: str) -> Any:
        if variant == "served":
            return models.load_model(path)[0]
        model = mlx_load_model(path)[0]
        swaps: dict[type, type] = {}
        for part in variant.split("+"):
            if part != "stock":
                swaps.update(classes[part])  # KeyError names an unknown part
        for _, module in model.named_modules():
            if type(module) in swaps and module.get("weight", mx.zeros(0, mx.float32)).dtype == mx.float32:
                module.__class__ = swaps[type(module)]
        return model

    def run(model: Any, n: int, steps: int) -> tuple[float, float, float, float, list[int]]:
        bg = BatchGenerator(model, max_tokens=1, prefill_batch_size=1, prefill_step_size=4096)
        bg.insert([list(range(100, 100 + n))], max_tokens=[steps + 1])
        c0, t0 = time.process_time(), time.perf_counter()
        tokens = [g.token for g in bg.next()[1]]  # the prompt, and its first token
        pp = (time.process_time() - c0, time.perf_counter() - t0)
        c0, t0 = time.process_time(), time.perf_counter()
        while len(tokens) < steps + 1:
            tokens += [g.token for g in bg.next()[1]]
        dec = (time.process_time() - c0, time.perf_counter() - t0)
        bg.close()
        return n / pp[0], n / pp[1], steps / dec[0], steps / dec[1], tokens

    variants = {v: load(v) for v in a.variants.split(",")}
    for model in variants.values():
        run(model, 16, 2)  # warm-up: MLX compiles what it compiles
    print(models.cpu_blas_status().description, "packed 4-bit" if a.packed else "float32")
    seen: dict[str, list[tuple[float, float, float, float, list[int]]]] = {v: [] for v in variants}
    for _ in range(a.rounds):
        for name, model in variants.items():
            seen[name].append(run(model, a.prompt, a.steps))
    print(f"load average {os.getloadavg()[0]:.1f}; medians of {a.rounds} alternated rounds")
    for name, runs in seen.items():
        med = [statistics.median(r[i] for r in runs) for i in range(4)]
        print(f"{name:>20}: prompt {med[0]:5.0f} tok/CPU-s ({med[1]:4.0f} wall)  decode "
              f"{med[2]:5.1f} tok/CPU-s ({med[3]:5.1f} wall)  per round "
              + " ".join(f"{r[2]:.1f}" for r in runs))
    if len({tuple(r[4]) for runs in seen.values() for r in runs}) > 1:
        print("TOKENS DIFFER between variants or rounds")
    else:
        print("same tokens in every variant and round")


if __name__ == "__main__":
    main()
