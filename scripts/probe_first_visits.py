"""Probe (GPU investigation): which decode steps pay a first visit (kernel compiles).

    python scripts/probe_first_visits.py MODEL_DIR [BATCH_SIZES]

After the actor's own warm-up (prefill groups of 1..8 prompts of 128 tokens,
two decode steps each), decodes batches of B rows (default 3,1,2,4,8,3)
from 128-token prompts for 300 steps each, past the KV cache's growth from
256 to 512 positions (mlx_lm grows it in steps of 256), and prints every
step over 0.2 s with the batch's cache position and buffer length. A step
of seconds the first time a batch size crosses a size, and not the second,
is a first visit: a warm-up could pay it before the server reports ready
(BENCHMARKS.md, finding 7).
"""
import random
import sys
import time

from mlx_lm.generate import BatchGenerator

from trio_mlx._models import load_model

path = sys.argv[1]
sizes = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "3,1,2,4,8,3").split(",")]
model, config = load_model(path)
vocab = int(config["vocab_size"])
rng = random.Random(0)
clock = time.perf_counter


def new_bg() -> BatchGenerator:
    return BatchGenerator(model, max_tokens=10**6, completion_batch_size=256, prefill_batch_size=8,
                          prefill_step_size=2048)


bg = new_bg()
for k in range(1, 9):  # the actor's warm-up
    bg.insert([[1] * 128 for _ in range(k)], max_tokens=[2] * k)
    for _ in range(64):
        _, generated = bg.next()
        if sum(1 for r in generated if r.finish_reason) >= k:
            break
bg.close()
print("warm-up done", flush=True)
for b in sizes:
    bg = new_bg()
    bg.insert([[rng.randrange(10, vocab) for _ in range(128)] for _ in range(b)])
    slow, times = [], []
    for step in range(300):
        t = clock()
        bg.next()
        ms = (clock() - t) * 1000
        times.append(ms)
        if ms > 200:
            caches = bg._generation_batch.prompt_cache
            c = caches[0] if caches else None
            slow.append((step, round(ms), getattr(c, "_idx", None),
                         None if c is None or c.keys is None else c.keys.shape[2]))
    bg.close()
    times.sort()
    print(f"B={b}: median {times[len(times) // 2]:.1f} ms, slow steps (step, ms, position, buffer): {slow}",
          flush=True)
