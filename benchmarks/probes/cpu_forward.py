"""The embedded default's forward pass on the CPU, timed in wall and process CPU seconds.

    python benchmarks/probes/cpu_forward.py [--packed] [--prompt 128] [--steps 16]

A 128-token prompt in one forward pass, then greedy single-token steps, with
whatever BLAS `trio_mlx.models` loaded (TRIO_MLX_CPU_BLAS=reference for the
wheel's own); the float32 (dequantized) variant unless --packed. Per CPU
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
    a = p.parse_args()
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = models.load_model(models.ensure_embedded_model(dequantize=not a.packed))

    def run(n: int, steps: int) -> tuple[float, float, float, float]:
        cache = make_prompt_cache(model)
        c0, t0 = time.process_time(), time.perf_counter()
        out = model(mx.array([list(range(100, 100 + n))]), cache=cache)
        mx.eval(out)
        pp = (time.process_time() - c0, time.perf_counter() - t0)
        y = mx.argmax(out[:, -1], -1)
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1], -1)
            mx.eval(y)
        dec = (time.process_time() - c0, time.perf_counter() - t0)
        return n / pp[0], n / pp[1], steps / dec[0], steps / dec[1]

    run(16, 2)  # warm-up
    print(models.cpu_blas_status().description, "packed 4-bit" if a.packed else "float32")
    for _ in range(a.rounds):
        r = run(a.prompt, a.steps)
        print(f"prompt {r[0]:.0f} tok/CPU-s ({r[1]:.0f} tok/s wall)  "
              f"decode {r[2]:.1f} tok/CPU-s ({r[3]:.1f} tok/s wall)")


if __name__ == "__main__":
    main()
