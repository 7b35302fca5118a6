"""Probe (GPU investigation): what a group of cached follow-ups costs on the shape grid.

    python benchmarks/probes/probe_row_attention.py MODEL_DIR

Warm-up builds the grid's prefill shapes for one row (`actor/_warmup.prebuild_prefill`);
a group of several follow-ups that enter together meets its own shapes live, and MLX's CUDA
backend builds a cuDNN attention graph for each (45-110 ms for one row). Times each `next()`
of a BatchGenerator over the grid-prefilling model until every row of a group of B rows has
its first token, the rows cached alike (as `_reuse.Reuse.even` leaves them), for:
- `stock`: the model as it is, one attention call for the group;
- `rows`: the attention called once per row (`mx.fast.scaled_dot_product_attention`
  wrapped here), so every call has a one-row shape that warm-up built;
and two query grids: powers of two (`pow2`) and multiples of 512 above 512 (`q512`).
Each (B, prefix, new) is run twice with other tokens: `first`, then `again`.
"""
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache

import trio_mlx.actor._batch as batch
from trio_mlx.actor._batch import GRID_PREFIX, CausalPrefill
from trio_mlx.actor._warmup import prebuild_prefill
from trio_mlx.models import load_model

model, config = load_model(sys.argv[1])
vocab = int(config["vocab_size"])
layers = len(model.layers)
SDPA = mx.fast.scaled_dot_product_attention
mode = {"rows": False}


def sdpa(q, k, v, *, scale, mask=None, sinks=None):
    if not mode["rows"] or q.shape[0] == 1 or q.shape[2] == 1 or not isinstance(mask, str):
        return SDPA(q, k, v, scale=scale, mask=mask, sinks=sinks)
    return mx.concatenate([SDPA(q[i : i + 1], k[i : i + 1], v[i : i + 1], scale=scale, mask=mask, sinks=sinks)
                           for i in range(q.shape[0])], axis=0)


mx.fast.scaled_dot_product_attention = sdpa
pow2 = batch.grid_length


def q512(n: int) -> int:
    return pow2(n) if n <= 512 else -(-n // 512) * 512


grid = CausalPrefill(model, grid=True)
t0 = time.perf_counter()
print("prebuilt", prebuild_prefill(grid, layers, 1, 8192, [128, 256, 512, 1024, 1536, 2048], GRID_PREFIX),
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
    mode["rows"] = rows_mode
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
