"""The embedded default's forward pass on the CPU, timed in wall and process CPU seconds.

    python benchmarks/probes/cpu_forward.py [--packed] [--prompt 128] [--steps 16] [--stock]

A 128-token prompt in one forward pass, then greedy single-token steps, with
whatever BLAS `trio_mlx.models` loaded (TRIO_MLX_CPU_BLAS=reference for the
wheel's own); the float32 (dequantized) variant unless --packed. The model is
loaded as the server loads it (`models.load_model`: one-row matmuls in row
blocks under OpenBLAS, `models/_cpu_decode.py`); --stock adds, alternated with
it in each round, the same weights loaded by mlx_lm alone. Per CPU
second figures stand in for an idle machine's on a shared one: with one BLAS
thread the work is one thread's, so tokens per CPU second is what an idle core
would do.
"""

from __future__ import annotations

import argparse
import time

from trio_mlx import models


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--packed", action="store_true", help="the 4-bit variant")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--stock", action="store_true", help="also mlx_lm's own loading, alternated")
    a = p.parse_args()
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as mlx_load_model

    path = models.ensure_embedded_model(dequantize=not a.packed)
    variants = {"served": models.load_model(path)[0]}
    if a.stock:
        variants["stock"] = mlx_load_model(path)[0]

    def run(model: object, n: int, steps: int) -> tuple[float, float, float, float, list[int]]:
        cache = make_prompt_cache(model)
        c0, t0 = time.process_time(), time.perf_counter()
        out = model(mx.array([list(range(100, 100 + n))]), cache=cache)  # type: ignore[operator]
        mx.eval(out)
        pp = (time.process_time() - c0, time.perf_counter() - t0)
        y = mx.argmax(out[:, -1], -1)
        tokens = []
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1], -1)  # type: ignore[operator]
            mx.eval(y)
            tokens.append(y.item())
        dec = (time.process_time() - c0, time.perf_counter() - t0)
        return n / pp[0], n / pp[1], steps / dec[0], steps / dec[1], tokens

    for model in variants.values():
        run(model, 16, 2)  # warm-up
    print(models.cpu_blas_status().description, "packed 4-bit" if a.packed else "float32")
    for _ in range(a.rounds):
        seen = {}
        for name, model in variants.items():
            r = run(model, a.prompt, a.steps)
            seen[name] = r[4]
            print(f"{name:>6}: prompt {r[0]:.0f} tok/CPU-s ({r[1]:.0f} tok/s wall)  "
                  f"decode {r[2]:.1f} tok/CPU-s ({r[3]:.1f} tok/s wall)")
        if len(seen) > 1:
            print("same tokens" if len({tuple(t) for t in seen.values()}) == 1 else "TOKENS DIFFER")


if __name__ == "__main__":
    main()
