"""Probe (GPU investigation): what one BatchGenerator step costs, by batch composition.

    python benchmarks/probes/probe_steps.py MODEL_DIR

A: prefilling k prompts into an empty batch, twice (the first visit of a
shape may compile kernels); B: the first decode steps at each batch size;
C: admitting k prompts into a batch of 56 that is decoding. Prints ms per
`next()`. benchmarks/2026-11-22-h100/process-actor/README.md says what it found.
"""
import random
import sys
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from trio_mlx.models import load_model

path = sys.argv[1]
model, config = load_model(path)
vocab = int(config["vocab_size"])
rng = random.Random(0)
clock = time.perf_counter
t_start = clock()


def prompts(k, n=128):
    return [[rng.randrange(10, vocab) for _ in range(n)] for _ in range(k)]


def new_bg():
    return BatchGenerator(model, max_tokens=10**6, completion_batch_size=256, prefill_batch_size=8,
                          prefill_step_size=2048)


def step(bg):
    t = clock()
    p, g = bg.next()
    return (clock() - t) * 1000, len(p), len(g)


def until_decoding(bg, n):
    times = []
    while True:
        ms, np_, ng = step(bg)
        times.append(round(ms, 1))
        if np_ == 0 and ng == n:
            return times


print("== A: prefill k prompts (length 100) into an empty batch: step ms, first visit then second")
for rep in range(2):
    for k in range(1, 9):
        bg = new_bg()
        uids = bg.insert(prompts(k, 100))
        times = until_decoding(bg, k)
        bg.remove(uids)
        print(f"rep {rep} k={k}: {times}", flush=True)
bg = new_bg()
uids: list[int] = []
print("== B: decode at batch size B: the first 3 steps, then the median of 8")
for B in [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]:
    uids += bg.insert(prompts(B - len(uids), 16))
    until_decoding(bg, B)
    first = [round(step(bg)[0], 1) for _ in range(3)]
    steady = sorted(step(bg)[0] for _ in range(8))
    print(f"B={B:3d} first3 {first} steady p50 {steady[4]:.2f}  (t={clock() - t_start:.0f}s)", flush=True)
bg.remove(uids[56:])
uids = uids[:56]
for _ in range(5):
    step(bg)
print("== C: admitting k prompts into a decoding batch of 56")
for rep in range(2):
    for k in [1, 2, 4, 7, 8]:
        new = bg.insert(prompts(k))
        times = until_decoding(bg, 56 + k)
        base = [round(step(bg)[0], 1) for _ in range(3)]
        bg.remove(new)
        after = [round(step(bg)[0], 1) for _ in range(3)]
        print(f"rep {rep} k={k}: steps {times}  then {base}  after remove {after}", flush=True)
mx.synchronize()
print(f"total {clock() - t_start:.0f}s")
