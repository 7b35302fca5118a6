"""Probe (GPU investigation): what each step of a cached follow-up costs on the shape grid.

    python benchmarks/probes/probe_grid_steps.py MODEL_DIR

After the warm-up's grid shapes (`actor/_warmup.prebuild_prefill`), a BatchGenerator over
the grid-prefilling model (`actor/_batch.CausalPrefill`) takes one-row follow-ups the way the
actor inserts prompt-cache hits: a cached prefix of a multiple of 1,024 tokens and 1,000-2,000
new ones. Times each `next()` until the row's first token (the prefill step, then the first
decode step), for prefixes met the first time and the same lengths again with other tokens.
MLX's CUDA backend takes cuDNN for a decode step too when the keys span a whole buffer whose
length is a multiple of 256, keyed by that length, as a grid prefill leaves them.
"""
import sys
import time

import mlx.core as mx
from gpu_timing import steps_to_first_token  # benchmarks/probes/, the script's folder
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache

from trio_mlx.actor._batch import GRID_PREFIX, CausalPrefill, grid_sizes
from trio_mlx.actor._warmup import prebuild_prefill
from trio_mlx.models import load_model

model, config = load_model(sys.argv[1])
vocab = int(config["vocab_size"])
layers = len(model.layers)
grid = CausalPrefill(model, grid=True)
t0 = time.perf_counter()
print("prebuilt", prebuild_prefill(grid, layers, 1, 8192, grid_sizes(2048), GRID_PREFIX),
      f"shapes in {time.perf_counter() - t0:.2f} s", flush=True)
bg = BatchGenerator(grid, max_tokens=3, completion_batch_size=8, prefill_batch_size=8, prefill_step_size=2048)


def follow_up(prefix: int, new: int, seed: int) -> list[float]:
    mx.random.seed(seed)
    ids = mx.random.randint(10, vocab - 10, (prefix + new,)).tolist()
    cache = [KVCache() for _ in range(layers)]
    mx.eval(model(mx.array([ids[:prefix]]), cache=cache))
    (uid,) = bg.insert([ids[prefix:]], caches=[cache], all_tokens=[ids[:prefix]])
    times = steps_to_first_token(bg, uid)
    while any(r.finish_reason is None for r in bg.next()[1] if r.uid == uid):
        pass
    return times


for label, seed in (("first", 1), ("again", 2)):
    for prefix, new in ((2048, 2005), (3072, 2110), (5120, 1207), (6144, 1350)):
        steps = follow_up(prefix, new, seed)
        print(f"{label:5s} prefix {prefix} new {new}: next() ms {', '.join(f'{s:.1f}' for s in steps)}", flush=True)
