"""Probe (GPU investigation): what an operation costs the first time it meets a shape.

    python benchmarks/probes/probe_new_shapes.py MODEL_DIR

Every chat turn prefills a prompt of a length not seen before. On an H100 a
prefill of a new shape took 70-150 ms more than the same shape again
(probe_prefill_mask.py). Times, for query lengths met once each, the first call
and a second call of: a matmul of the MLP's shape, the fused attention with
mask="causal" behind a 6,000-token prefix, the same attention with an array
mask, a write into a preallocated KV buffer, and the whole model's prefill.
"""
import statistics
import sys

import mlx.core as mx
from gpu_timing import load, timed  # benchmarks/probes/, the script's folder
from mlx_lm.models.cache import KVCache

model, layers, vocab = load(sys.argv[1])
dt = mx.bfloat16


w = mx.random.normal((2048, 8192)).astype(dt)
k = mx.random.normal((1, 8, 8192, 64)).astype(dt)
v = mx.random.normal((1, 8, 8192, 64)).astype(dt)
buf = mx.zeros((1, 8, 8192, 64), dtype=dt)
mx.eval(w, k, v, buf)


def cases(n: int):
    x = mx.random.normal((1, n, 2048)).astype(dt)
    q = mx.random.normal((1, 32, n, 64)).astype(dt)
    s = 6000 + n
    mask = mx.tril(mx.ones((n, s), dtype=mx.bool_), k=s - n)
    new_kv = mx.random.normal((1, 8, n, 64)).astype(dt)
    mx.eval(x, q, mask, new_kv)

    def write():
        b = mx.array(buf)
        b[..., 6000 : 6000 + n, :] = new_kv
        return b

    def forward():
        cache = [KVCache() for _ in range(layers)]
        model(mx.zeros((1, 64), dtype=mx.int32), cache=cache)  # a short prefix: its shape repeats
        return model(mx.random.randint(0, vocab, (1, n)), cache=cache)

    return {
        "matmul": lambda: x @ w,
        "sdpa causal": lambda: mx.fast.scaled_dot_product_attention(q, k[:, :, :s], v[:, :, :s], scale=0.125,
                                                                    mask="causal"),
        "sdpa array": lambda: mx.fast.scaled_dot_product_attention(q, k[:, :, :s], v[:, :, :s], scale=0.125,
                                                                   mask=mask),
        "kv write": write,
        "model": forward,
    }


for n in (1024, 1024):  # warm every kind once
    for fn in cases(n).values():
        timed(fn)
rows: dict[str, list[tuple[float, float]]] = {}
for i in range(5):
    n = 1100 + 37 * i
    for name, fn in cases(n).items():
        rows.setdefault(name, []).append((timed(fn), timed(fn)))
for name, pairs in rows.items():
    first = [a for a, _ in pairs]
    again = [b for _, b in pairs]
    print(f"{name:12s} first {statistics.median(first):7.1f} ms ({', '.join(f'{a:.1f}' for a in first)}), "
          f"again {statistics.median(again):6.1f} ms", flush=True)
