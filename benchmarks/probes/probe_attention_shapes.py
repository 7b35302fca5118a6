"""Probe (GPU): what an operation costs the first time it meets a shape, MLX alone.

    python benchmarks/probes/probe_attention_shapes.py

Each line times one operation, synchronously, over a run of shapes it has not met
(then, for attention, the same shapes again): RoPE at new offsets, MLX's fused
attention with 5 queries (causal, or an array mask) and with 1 query at new key
lengths, a 5-row slice update at new offsets. On CUDA the fused attention of several
queries builds a cuDNN graph for each new pair of query and key lengths
(`trio_mlx/actor/_shapes.py`: `few_queries`; `_batch.CausalPrefill`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx


def timed(name: str, op: Callable[[int], Any], sizes: Iterable[int]) -> None:
    ms = []
    for n in sizes:
        t0 = time.perf_counter()
        mx.eval(op(n))
        ms.append(1e3 * (time.perf_counter() - t0))
    print(f"{name:40s} " + " ".join(f"{t:.1f}" for t in ms[:6]) + f" | median {statistics.median(ms):.2f} ms",
          flush=True)


def main() -> None:
    q = mx.random.normal((1, 32, 5, 64)).astype(mx.bfloat16)
    q1 = q[:, :, :1]
    kv = mx.random.normal((1, 8, 400, 64)).astype(mx.bfloat16)
    buf = mx.zeros((1, 8, 512, 64), dtype=mx.bfloat16)
    mx.eval(q, kv, buf)

    def rope(n: int) -> Any:
        return mx.fast.rope(q, 64, traditional=False, base=500000.0, scale=1.0, offset=n)

    def attend(queries: Any, mask: Any = None) -> Callable[[int], Any]:
        def op(n: int) -> Any:
            m = mx.ones((queries.shape[2], n), dtype=mx.bool_) if mask == "array" else mask
            return mx.fast.scaled_dot_product_attention(queries, kv[:, :, :n], kv[:, :, :n], scale=0.1, mask=m)
        return op

    def update(n: int) -> Any:
        buf[..., n : n + 5, :] = q[:, :8]
        return buf

    timed("rope, 5 queries, new offsets", rope, range(100, 112))
    timed("attention, 5 queries causal, new keys", attend(q, "causal"), range(100, 112))
    timed("attention, 5 queries causal, same again", attend(q, "causal"), range(100, 112))
    timed("attention, 5 queries array mask, new", attend(q, "array"), range(140, 152))
    timed("attention, 1 query, new key lengths", attend(q1), range(120, 132))
    timed("slice update, 5 rows at new offsets", update, range(160, 172))


if __name__ == "__main__":
    main()
