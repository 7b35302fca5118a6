"""Probe (CUDA only): `_cuda_attention.attention` against the attention as matmuls
(`_shapes.attention`, what MLX computes without a fused kernel) for one and several queries,
causal and under array masks, over short contexts (one block over all the keys) and long
ones (the keys split), for the head layouts of SmolLM2-135M, Llama-3.2-1B and an 8B; the
reference in float32 on the host's CPU (the GPU's float32 matmuls may round as TF32).

    PYTHONPATH=. python benchmarks/probes/probe_few_query_kernel.py

Prints each case's largest difference (float32 and bfloat16) and FAIL past the tolerance,
then the host time of a layer's attention each way (the kernel is one launch, the matmuls
five), mean over 200 calls evaluated together.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from trio_mlx.actor import _cuda_attention, _shapes


def case(b: int, h: int, kv: int, d: int, n: int, total: int, mask: str, dtype: mx.Dtype, rng: np.random.Generator):
    q = mx.array(rng.standard_normal((b, h, n, d)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((b, kv, total, d)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((b, kv, total, d)).astype(np.float32)).astype(dtype)
    causal = np.tril(np.ones((n, total), dtype=bool), k=total - n)
    if mask == "causal":
        m: object = "causal"
        ref_mask = mx.array(causal)[None, None]
    else:
        pad = np.broadcast_to(causal, (b, 1, n, total)).copy()
        for r in range(b):
            pad[r, :, :, : (r * 7) % max(1, total - n)] = False  # left padding, per row
        ref_mask = mx.array(pad) if mask == "bool" else mx.array(np.where(pad, 0.0, -np.inf).astype(np.float32)).astype(dtype)
        m = ref_mask
    assert _cuda_attention.applies(q, k, v, m), (b, h, kv, d, n, total, mask)
    got = _cuda_attention.attention(q, k, v, 0.125, m)
    with mx.stream(mx.cpu):  # in float32 on the host: the GPU's float32 matmuls may round as TF32
        want = _shapes.attention(*(a.astype(mx.float32) for a in (q, k, v)), 0.125, ref_mask)
        mx.eval(want)
    diff = float(mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))))
    return diff, q, k, v, m, ref_mask


def main() -> None:
    assert _cuda_attention.available(), "CUDA only"
    rng = np.random.default_rng(0)
    fails = 0
    for (h, kv, d) in ((9, 3, 64), (32, 8, 64), (32, 8, 128)):
        for b in (1, 4):
            for n in (1, 2, 9, 33, 65):
                for total in (n + 40, 3000):
                    for mask in ("causal", "bool", "additive"):
                        if mask == "causal" and n == 1:
                            continue
                        for dtype in (mx.float32, mx.bfloat16):
                            if not _cuda_attention.applies(mx.zeros((b, h, n, d), dtype=dtype),
                                                           mx.zeros((b, kv, total, d), dtype=dtype),
                                                           mx.zeros((b, kv, total, d), dtype=dtype),
                                                           "causal" if mask == "causal" else mx.ones((b, 1, n, total), dtype=mx.bool_)):
                                print(f"skip (reads) h={h} kv={kv} d={d} b={b} n={n} T={total}")
                                continue
                            diff, *_ = case(b, h, kv, d, n, total, mask, dtype, rng)
                            tol = 1e-5 if dtype == mx.float32 else 3e-2
                            bad = diff > tol
                            fails += bad
                            if bad or n in (1, 33):
                                print(f"{'FAIL' if bad else 'ok  '} h={h} kv={kv} d={d} b={b} n={n} T={total} "
                                      f"{mask:8s} {str(dtype):14s} max diff {diff:.2e}")
    print(f"== {fails} failed")
    for (h, kv, d, n, total) in ((9, 3, 64, 33, 1000), (9, 3, 64, 9, 1000), (32, 8, 64, 9, 1000)):
        _, q, k, v, m, ref = case(1, h, kv, d, n, total, "causal", mx.bfloat16, rng)
        for name, fn, mask in (("kernel", _cuda_attention.attention, m), ("matmuls", _shapes.attention, ref)):
            mx.eval(fn(q, k, v, 0.125, mask))
            t0 = time.perf_counter()
            outs = [fn(q, k, v, 0.125, mask) for _ in range(200)]
            built = time.perf_counter()
            mx.eval(outs)
            done = time.perf_counter()
            print(f"h={h} kv={kv} d={d} n={n} T={total} {name:8s} graph {1e6 * (built - t0) / 200:6.1f} us, "
                  f"graph+eval {1e6 * (done - t0) / 200:6.1f} us a call")


if __name__ == "__main__":
    main()
