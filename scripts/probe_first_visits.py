"""Probe (GPU investigation): which decode steps pay a first visit (kernel compiles).

    python scripts/probe_first_visits.py MODEL_DIR [BATCH_SIZES]

After the actor's own warm-up (prefill groups of 1..8 prompts of 128 tokens,
two decode steps each), for each B in BATCH_SIZES (default 3,1,2,4,8,3):

- fresh: B rows from 128-token prompts decode 300 steps, past the KV
  cache's growth from 256 to 512 positions (mlx_lm grows it in steps of 256);
- removal: one row decodes 20 steps, then B more join (so their padding
  differs), all decode 140 steps, the oldest row leaves as the actor removes
  it (`_actor._remove_rows`, which trims the padding all rows share), and
  the B left decode 40 more: the Poisson run's stall of finding 7 came in
  the step after such a removal.

Prints every step over 0.2 s with the batch's cache position and buffer
length. A step of seconds the first time a shape is met, and not the
second, is a first visit: a warm-up could pay it before the server reports
ready (BENCHMARKS.md, finding 7).
"""
import random
import sys
import time

from mlx_lm.generate import BatchGenerator

from trio_mlx._actor import _remove_rows
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


def prompts(k: int) -> list[list[int]]:
    return [[rng.randrange(10, vocab) for _ in range(128)] for _ in range(k)]


def run(bg: BatchGenerator, steps: int, slow: list, label: str, times: list[float]) -> None:
    for _ in range(steps):
        t = clock()
        bg.next()
        ms = (clock() - t) * 1000
        times.append(ms)
        if ms > 200:
            caches = bg._generation_batch.prompt_cache
            c = caches[0] if caches else None
            slow.append((label, len(times), round(ms), getattr(c, "_idx", None),
                         None if c is None or c.keys is None else c.keys.shape[2]))


for b in sizes:
    for scenario in ("fresh", "removal"):
        bg = new_bg()
        slow: list = []
        times: list[float] = []
        if scenario == "fresh":
            bg.insert(prompts(b))
            run(bg, 300, slow, "decode", times)
        else:
            (oldest,) = bg.insert(prompts(1))
            run(bg, 20, slow, "one row", times)
            bg.insert(prompts(b))
            run(bg, 140, slow, "joined", times)
            _remove_rows(bg, [oldest])
            run(bg, 40, slow, "after removal", times)
        bg.close()
        times.sort()
        print(f"B={b} {scenario}: median {times[len(times) // 2]:.1f} ms, "
              f"slow steps (phase, step, ms, position, buffer): {slow}", flush=True)
