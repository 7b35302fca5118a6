"""Probe (GPU investigation): does a contiguous K/V spare the fused attention its build per shape?

    python benchmarks/probes/probe_contiguous_kv.py MODEL_DIR

probe_new_shapes.py found that MLX's CUDA backend builds a cuDNN graph for every
new prefill attention shape (65-110 ms on an H100 against 0.6 ms to run one again).
Its keys were slices of a preallocated buffer, as mlx_lm's KV caches hand them
out. Times, for lengths met once each, the first and a second call of the causal
attention with K/V as such slices and as contiguous copies (several batch rows and
context lengths past 12,000 included), then a whole-model prefill behind a cached
prefix with a cache that returns its slices as they are and one that returns
contiguous copies.
"""
import statistics
import sys

import mlx.core as mx
from gpu_timing import load, timed  # benchmarks/probes/, the script's folder
from mlx_lm.models.cache import KVCache

model, layers, vocab = load(sys.argv[1])
dt = mx.bfloat16


class ContiguousKV(KVCache):
    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(keys, values)
        return mx.contiguous(k), mx.contiguous(v)


def attention(rows: int, n: int, prefix: int, contiguous: bool):
    q = mx.random.normal((rows, 32, n, 64)).astype(dt)
    buf_k = mx.random.normal((rows, 8, prefix + n + 256, 64)).astype(dt)
    buf_v = mx.random.normal((rows, 8, prefix + n + 256, 64)).astype(dt)
    mx.eval(q, buf_k, buf_v)
    s = prefix + n

    def run():
        k, v = buf_k[:, :, :s], buf_v[:, :, :s]
        if contiguous:
            k, v = mx.contiguous(k), mx.contiguous(v)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")

    return run


def forward(n: int, prefix: int, kind):
    prompt = mx.random.randint(0, vocab, (1, prefix))
    tail = mx.random.randint(0, vocab, (1, n))
    cache = [kind() for _ in range(layers)]
    mx.eval(model(prompt, cache=cache))

    def run():
        for c in cache:
            c.trim(c.offset - prefix)
        return model(tail, cache=cache)

    return run


def report(name, pairs):
    first = [a for a, _ in pairs]
    again = [b for _, b in pairs]
    print(f"{name:34s} first {statistics.median(first):7.1f} ms ({', '.join(f'{a:.1f}' for a in first)}), "
          f"again {statistics.median(again):6.1f} ms", flush=True)


for contiguous in (False, True):  # warm each kind once
    f = attention(1, 1000, 5000, contiguous)
    f(), f()
for rows, prefix in ((1, 6000), (4, 6000), (1, 14000)):
    for contiguous in (False, True):
        pairs = []
        for i in range(5):
            f = attention(rows, 1100 + 37 * i + 3 * contiguous, prefix + 101 * i, contiguous)
            pairs.append((timed(f), timed(f)))
        report(f"sdpa rows={rows} prefix~{prefix} {'contig' if contiguous else 'slices'}", pairs)
for kind in (KVCache, ContiguousKV):
    pairs = []
    for i in range(5):
        f = forward(900 + 41 * i + 7 * (kind is ContiguousKV), 3000 + 211 * i, kind)
        pairs.append((timed(f), timed(f)))
    report(f"model prefill {kind.__name__}", pairs)
