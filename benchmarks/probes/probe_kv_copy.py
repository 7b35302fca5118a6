"""Probe (GPU investigation): how fast the KV moves when rows join, leave or are kept.

    python benchmarks/probes/probe_kv_copy.py [ROWS] [CONTEXT] [LAYERS]

A batch's membership changes move its KV: mlx_lm's `BatchKVCache.filter` (rows leave),
`extend` (a group joins), `merge` (cached prefixes become a group), `extract` (a finished
row is kept), `finalize` (a right-padded group is rolled). On an H100 the steps in which
a group of 7 chat follow-ups (~1.7 GB of KV) joined or left a batch took 30-58 ms in the
step traces. This times each of those operations on a 1B-shaped KV (8 KV heads of 64,
bf16; LAYERS layers, 16 by default) for ROWS rows (8) at CONTEXT tokens (7,500), beside
a plain copy of the same bytes and the actor's replacements of the gathers
(`_batch.take_rows`, `roll_right`), and prints each one's median ms and GB/s (bytes of
KV read once and written once). benchmarks/2026-11-25-h100/kv-copies/ has its figures.
"""
from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, dynamic_roll

from trio_mlx.actor._batch import roll_right, take_rows

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 8
context = int(sys.argv[2]) if len(sys.argv) > 2 else 7500
layers = int(sys.argv[3]) if len(sys.argv) > 3 else 16
heads, dim, dtype = 8, 64, mx.bfloat16
clock = time.perf_counter


def timed(name: str, build, moved_rows: int, repeat: int = 7) -> None:
    """`build()` returns the arrays to evaluate; moved_rows x context x layers of KV moved."""
    out = []
    for i in range(repeat + 1):
        mx.synchronize()
        t0 = clock()
        mx.eval(build())
        mx.synchronize()
        if i:
            out.append(clock() - t0)
    report(name, out, moved_rows)


def report(name: str, seconds: list[float], moved_rows: int) -> None:
    """The median ms and the rate: moved_rows x context x layers of KV, read and written."""
    ms = statistics.median(seconds) * 1e3
    gb = 2 * moved_rows * context * layers * heads * dim * 2 * 2 / 1e9  # keys and values, read and written
    print(f"{name:<34} {ms:8.2f} ms  {gb / (ms / 1e3):8.1f} GB/s  ({gb / 2:.2f} GB of KV)")


def filled(n: int, padding: list[int] | None = None) -> list[BatchKVCache]:
    """LAYERS BatchKVCaches of `n` rows holding `context` tokens, as a prefill leaves them."""
    caches = []
    for _ in range(layers):
        c = BatchKVCache(padding or [0] * n)
        k = mx.random.normal((n, heads, context, dim)).astype(dtype)
        c.update_and_fetch(k, k * 2)
        caches.append(c)
    mx.eval([c.state for c in caches])
    return caches


print(f"mlx {mx.__version__} on {mx.default_device()}: {rows} rows x {context} tokens x {layers} layers")
plain = [mx.random.normal((rows, heads, context, dim)).astype(dtype) for _ in range(2 * layers)]
mx.eval(plain)
timed("plain copy (x + 0)", lambda: [a + 0 for a in plain], rows)
timed("contiguous slice [..., :ctx-100, :]", lambda: [mx.contiguous(a[..., : context - 100, :]) for a in plain], rows)

batch = filled(rows)


def filter_one() -> list:
    fresh = filled(rows)
    mx.synchronize()
    t0 = clock()
    for c in fresh:
        c.filter(list(range(1, rows)))
    mx.eval([c.state for c in fresh])
    mx.synchronize()
    return [clock() - t0]


def once(name: str, run, moved_rows: int) -> None:
    """An operation that changes its caches in place: fresh caches each time, only the call timed."""
    report(name, [run()[0] for _ in range(4)][1:], moved_rows)


if rows > 1:
    once(f"filter (keep {rows - 1} of {rows})", filter_one, rows - 1)
    keep = [i for i in range(rows) if i != rows // 2]
    timed("gather a[mx.array(keep)]", lambda: [a[mx.array(keep)] for a in plain], rows - 1)
    timed("take_rows (slices)", lambda: [take_rows(a, keep) for a in plain], rows - 1)


def extend_one() -> list:
    big, one = filled(rows - 1), filled(1)
    mx.synchronize()
    t0 = clock()
    for a, b in zip(big, one, strict=True):
        a.extend(b)
    mx.eval([c.state for c in big])
    mx.synchronize()
    return [clock() - t0]


once(f"extend ({rows - 1} rows + 1)", extend_one, rows)


def extract_all() -> list:
    caches = filled(rows)
    mx.synchronize()
    t0 = clock()
    kept = [[c.extract(i) for c in caches] for i in range(rows)]
    mx.eval([c.state for row in kept for c in row])
    mx.synchronize()
    return [clock() - t0]


once(f"extract every row ({rows})", extract_all, rows)


def merge_rows() -> list:
    singles = []
    for _ in range(rows):
        row = []
        for _ in range(layers):
            c = KVCache()
            k = mx.random.normal((1, heads, max(16, context - 8 * len(singles)), dim)).astype(dtype)
            c.update_and_fetch(k, k)
            row.append(c)
        singles.append(row)
    mx.eval([c.state for row in singles for c in row])
    mx.synchronize()
    t0 = clock()
    merged = [BatchKVCache.merge([row[j] for row in singles]) for j in range(layers)]
    mx.eval([c.state for c in merged])
    mx.synchronize()
    return [clock() - t0]


once(f"merge ({rows} single rows)", merge_rows, rows)
shift = mx.array([[i * 3] for i in range(rows)])
timed(f"dynamic_roll ({rows} rows)", lambda: [dynamic_roll(a, shift, axis=2) for a in plain], rows)
shifts = [i * 3 for i in range(rows)]
timed(f"roll_right ({rows} rows, slices)", lambda: [roll_right(a, shifts) for a in plain], rows)
timed("update_and_fetch 1 token (shared)", lambda: [c.update_and_fetch(plain[0][:, :, :1], plain[0][:, :, :1])
                                                      for c in batch], 0)
