"""Probe (GPU investigation): what a group of cached follow-ups costs on the shape grid.

    python benchmarks/probes/probe_row_attention.py MODEL_DIR

Warm-up builds the grid's prefill shapes for one row (`actor/_warmup.prebuild_prefill`);
a group of several follow-ups that enter together meets its own shapes live, and MLX's CUDA
backend builds a cuDNN attention graph for each (45-110 ms for one row). Times each `next()`
of a BatchGenerator over the grid-prefilling model until every row of a group of B rows has
its first token, the rows cached alike (as `_reuse.Reuse.even` leaves them), for:
- `stock`: the attention called once for the group (`_batch._row_attention` replaced
  here by a single call);
- `rows`: the attention called once per row, as `actor/_batch.CausalPrefill` does, so
  every call has a one-row shape that warm-up built;
and two query grids: powers of two (`pow2`) and multiples of 512 above 512 (`q512`).
Each (B, prefix, new) is run twice with other tokens: `first`, then `again`.
"""
import statistics
import sys
import time

import mlx.core as mx
from gpu_timing import load  # benchmarks/probes/, the script's folder
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache

import trio_mlx.actor._batch as batch
from trio_mlx.actor._batch import GRID_PREFIX, CausalPrefill
from trio_mlx.actor._warmup import prebuild_prefill

model, layers, vocab = load(sys.argv[1])
row_attention = batch._row_attention


def one_call(sdpa, queries, keys, values, **kwargs):
    return sdpa(queries, keys, values, **kwargs)


q512 = batch.grid_length  # the grid as the actor runs it


def pow2(n: int) -> int:  # the grid before it: powers of two all the way
    return max(batch.GRID_MIN, 1 << (n - 1).bit_length())


grid = CausalPrefill(model, grid=True)
t0 = time.perf_counter()
print("prebuilt", prebuild_prefill(grid, layers, 1, 8192, batch.grid_sizes(2048), GRID_PREFIX),
      f"one-row shapes in {time.perf_counter() - t0:.2f} s", flush=True)
bg = BatchGenerator(grid, max_tokens=2, completion_batch_size=8, prefill_batch_size=8, prefill_step_size=2048)


def group(rows: int, prefix: int, new: int, seed: int) -> list[float]:
    mx.random.seed(seed)
    prompts, caches = [], []
    for _ in range(rows):
        ids = mx.random.randint(10, vocab - 10, (prefix + new,)).tolist()
        cache = [KVCache() for _ in range(layers)]
        mx.eval(model(mx.array([ids[:prefix]]), cache=cache))
        prompts.append(ids)
        caches.append(cache)
    uids = set(bg.insert([p[prefix:] for p in prompts], caches=caches, all_tokens=[p[:prefix] for p in prompts]))
    times, first = [], set()
    while first != uids:
        mx.synchronize()
        t = time.perf_counter()
        _, gen = bg.next()
        mx.synchronize()
        times.append(1e3 * (time.perf_counter() - t))
        first |= {r.uid for r in gen}
    while bg.next()[1]:
        pass
    return times


totals: dict[str, list[float]] = {}
for name, rows_mode, grid_fn in (("stock pow2", False, pow2), ("rows pow2", True, pow2),
                                 ("rows q512", True, q512), ("stock q512", False, q512)):
    batch._row_attention = row_attention if rows_mode else one_call
    batch.grid_length = grid_fn
    for rows in (2, 4, 8):
        for prefix, new in ((4096, 1350), (6144, 1351)):
            for label, seed in (("first", 1), ("again", 2)):
                steps = group(rows, prefix, new, seed + 10 * rows)
                totals.setdefault(f"{name} {label}", []).append(sum(steps))
                print(f"{name:10s} {label:5s} rows {rows} prefix {prefix} new {new}: total {sum(steps):6.1f} ms"
                      f" (next() ms {', '.join(f'{s:.1f}' for s in steps)})", flush=True)
for key, vals in totals.items():
    print(f"{key:18s} median total {statistics.median(vals):6.1f} ms over {len(vals)}", flush=True)
