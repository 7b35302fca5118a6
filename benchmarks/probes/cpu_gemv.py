"""One-row matmuls (a decode step's) on MLX's CPU backend, in GB/s of weights read per CPU second.

    python benchmarks/probes/cpu_gemv.py [--rows 1] [--reps 8]

For the embedded default's matrix shapes (N x K, as nn.Linear stores them:
1536x576 gate/up, 576x1536 down, 576x576 q/o, 192x576 k/v, 49152x576 the tied
output projection), `x @ W.T` with `x` of `--rows` rows, for each way the
weights could be held: float32 in one matmul (MLX calls cblas_sgemm), float32
in row blocks of <= 1024 rows (`models/_cpu_decode.py`), bfloat16, float16,
8- and 4-bit quantized (MLX's own CPU kernels), and OpenBLAS's `sgemv` called
directly (what a one-row product could read at best through this BLAS).
Enough distinct copies of each matrix to pass ~120 MB a round, so that caches
do not flatter it. Run under whatever BLAS `trio_mlx.models` loaded.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from trio_mlx import models
from trio_mlx.models import _cpu_blas, _cpu_decode

SHAPES = [(1536, 576), (576, 1536), (576, 576), (192, 576), (49152, 576)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--reps", type=int, default=8)
    a = p.parse_args()
    import mlx.core as mx

    def rate(f: Callable[[], object], nbytes: int) -> float:
        f()
        c0 = time.process_time()
        for _ in range(a.reps):
            f()
        return nbytes / ((time.process_time() - c0) / a.reps) / 1e9

    def products(x: Any, ws: list[Any]) -> None:
        mx.eval([x @ w.T for w in ws])

    def calls(x: Any, layers: list[Any]) -> None:
        mx.eval([layer(x) for layer in layers])

    def quantized(x: Any, qs: list[Any], bits: int) -> None:
        mx.eval([mx.quantized_matmul(x, *q, transpose=True, group_size=64, bits=bits) for q in qs])

    print(models.cpu_blas_status().description, f"x of {a.rows} row(s); GB of weights per CPU second")
    print(f"{'N x K':>10} {'f32':>6} {'blocks':>6} {'bf16':>6} {'f16':>6} {'q8':>6} {'q4':>6} {'sgemv':>6}")
    for n, k in SHAPES:
        copies = max(1, int(120e6 // (n * k * 4)))
        ws = [mx.random.normal((n, k), key=mx.random.key(i)) for i in range(copies)]
        x = mx.random.normal((a.rows, k), key=mx.random.key(10**6))
        mx.eval(ws, x)
        f32 = n * k * 4 * copies
        row = [rate(partial(products, x, ws), f32)]
        lins = []
        for w in ws:
            lin = _cpu_decode.RowBlockLinear(k, n, bias=False)
            lin.weight = w
            lins.append(lin)
        row.append(rate(partial(calls, x, lins), f32))
        for dtype in (mx.bfloat16, mx.float16):
            wd, xd = [w.astype(dtype) for w in ws], x.astype(dtype)
            mx.eval(wd, xd)
            row.append(rate(partial(products, xd, wd), f32 // 2))
        for bits in (8, 4):
            qs = [mx.quantize(w, group_size=64, bits=bits) for w in ws]
            mx.eval(qs)
            nbytes = sum(part.nbytes for q in qs for part in q)
            row.append(rate(partial(quantized, x, qs, bits), nbytes))
        row.append(_sgemv_rate(ws, n, k, rate) if a.rows == 1 else float("nan"))
        print(f"{n:>5}x{k:<4} " + " ".join(f"{r:6.1f}" for r in row))


def _sgemv_rate(ws: list[Any], n: int, k: int, rate: Callable[..., float]) -> float:
    """OpenBLAS's own sgemv on the same matrices (NaN without trio_mlx's OpenBLAS)."""
    import numpy as np

    handle = _cpu_blas._handle
    if handle is None:
        return float("nan")
    mats = [np.array(w) for w in ws]
    xv = np.ones(k, np.float32)
    yv = np.zeros(n, np.float32)
    ptr = ctypes.c_void_p

    def run() -> None:
        for m in mats:  # CblasRowMajor, CblasNoTrans: y = W x
            handle.scipy_cblas_sgemv(101, 111, n, k, ctypes.c_float(1.0), ptr(m.ctypes.data), k,
                                     ptr(xv.ctypes.data), 1, ctypes.c_float(0.0), ptr(yv.ctypes.data), 1)

    return float(rate(run, n * k * 4 * len(mats)))


if __name__ == "__main__":
    main()
