"""Probe (GPU investigation): how much of a decode step holds the GIL, at a batch width.

    python benchmarks/probes/probe_step_python.py MODEL_DIR [ROWS ...]

For each width (default 64 and 256): a BatchGenerator decoding that many rows of
128-token prompts, 60 steps timed for wall and the calling thread's CPU, then 60
steps under cProfile. A step's wall time outside the calls that release the GIL
(`eval`, `async_eval`, `synchronize`, `array.tolist`, `array.item`: MLX's bindings
drop it while they launch or wait) is the time it holds the GIL: what a thread
actor takes from the event loop each step, and what the event loop's work can
cost it.
"""
import cProfile
import pstats
import random
import statistics
import sys
import time

import mlx.core as mx
from gpu_timing import load  # benchmarks/probes/, the script's folder
from mlx_lm.generate import BatchGenerator

RELEASING = ("eval", "async_eval", "synchronize")  # mlx.core functions that drop the GIL
released = [0.0]  # seconds inside them (and inside array.tolist / item), on this thread


def timed(fn):
    def call(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            released[0] += time.perf_counter() - t
    return call


for name in RELEASING:
    setattr(mx, name, timed(getattr(mx, name)))
for name in ("tolist", "item"):
    setattr(mx.array, name, timed(getattr(mx.array, name)))

path = sys.argv[1]
widths = [int(a) for a in sys.argv[2:]] or [64, 256]
model, _, vocab = load(path)
rng = random.Random(0)


def decoding(rows: int) -> BatchGenerator:
    bg = BatchGenerator(model, max_tokens=10**6, completion_batch_size=rows, prefill_batch_size=8,
                        prefill_step_size=2048)
    bg.insert([[rng.randrange(10, vocab) for _ in range(128)] for _ in range(rows)], [10**6] * rows)
    while True:
        prompts, gens = bg.next()
        if not prompts and len(gens) == rows:
            return bg


for rows in widths:
    bg = decoding(rows)
    for _ in range(10):
        bg.next()
    walls, cpus, holds = [], [], []
    for _ in range(60):
        released[0] = 0.0
        w0, c0 = time.perf_counter(), time.thread_time()
        bg.next()
        wall = time.perf_counter() - w0
        walls.append(1e3 * wall)
        cpus.append(1e3 * (time.thread_time() - c0))
        holds.append(1e3 * (wall - released[0]))
    print(f"rows {rows}: step wall ms p50 {statistics.median(walls):.2f}, thread CPU ms p50 "
          f"{statistics.median(cpus):.2f}, holding the GIL ms p50 {statistics.median(holds):.2f} "
          f"(wall outside eval/async_eval/synchronize/tolist/item)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(30):
        bg.next()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(10)
    del bg
