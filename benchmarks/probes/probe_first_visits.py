"""Probe (GPU investigation): which decode steps pay a first visit (kernel compiles).

    MLX_PTX_CACHE_DIR=$(mktemp -d) python benchmarks/probes/probe_first_visits.py MODEL_DIR [BATCH_SIZES] [--warm]

After a warm-up (with --warm the actor's own, `Actor._warmup` as on a GPU;
without, its prefill groups of 1..8 prompts of 128 tokens alone,
`_actor.warm_up`), for each B in BATCH_SIZES (default 3,1,2,4,8,3):

- fresh: B rows from 128-token prompts decode 300 steps, past the KV
  cache's growth from 256 to 512 positions (mlx_lm grows it in steps of 256);
- removal: one row decodes 20 steps, then B more join (so their padding
  differs), all decode 140 steps, the oldest row leaves as the actor removes
  it (`_actor._remove_rows`, which trims the padding all rows share), and
  the B left decode 250 more, past the end of the trimmed buffer: the
  Poisson run's 3.3 s stall (benchmarks/2026-11-23-h100/warmup/) came in the step after such a removal.

Prints every step over 0.2 s with the batch's cache position and buffer
length, and every step in which MLX compiled a CUDA kernel module. MLX
writes each module it compiles to its PTX cache (MLX_PTX_CACHE_DIR, by
default /tmp/mlx/VERSION/ptx, kept across processes), so start with an
empty one to see them all. A step of seconds that compiles the first time
a shape is met, and not the second, is a first visit: a warm-up can pay it
before the server reports ready (benchmarks/2026-11-23-h100/warmup/README.md).
"""
import os
import random
import sys
import time
from pathlib import Path

from mlx_lm.generate import BatchGenerator

from trio_mlx.actor import ActorConfig
from trio_mlx.actor._actor import Actor
from trio_mlx.actor._batch import remove_rows as _remove_rows
from trio_mlx.actor._warmup import warm_up

args = [a for a in sys.argv[1:] if not a.startswith("--")]
warm = "--warm" in sys.argv
path = args[0]
sizes = [int(x) for x in (args[1] if len(args) > 1 else "3,1,2,4,8,3").split(",")]
ptx = os.environ.get("MLX_PTX_CACHE_DIR")
actor = Actor(ActorConfig(model_path=Path(path)), link=None)  # type: ignore[arg-type]  # never reaches a link
config = actor._load()
model, vocab = actor._model, int(config["vocab_size"])
rng = random.Random(0)
clock = time.perf_counter


def modules() -> set[str]:
    """The kernel modules in MLX's PTX cache (one .ptx file each)."""
    return {f[:-4] for f in os.listdir(ptx) if f.endswith(".ptx")} if ptx and os.path.isdir(ptx) else set()


def new_bg() -> BatchGenerator:
    return BatchGenerator(model, max_tokens=10**6, completion_batch_size=256, prefill_batch_size=8,
                          prefill_step_size=2048)


seen = modules()
t = clock()
if warm:
    actor._gpu = True  # the GPU's warm-up, wherever this runs
    actor._warmup()
else:
    warm_up(actor._bg, token=1, length=128, groups=8)
actor._bg.close()
compiled = modules() - seen
seen |= compiled
label = "the actor's" if warm else "prefill groups only"
print(f"warm-up ({label}) done in {clock() - t:.1f} s, "
      f"{len(compiled)} modules compiled: {sorted(compiled)}", flush=True)


def prompts(k: int) -> list[list[int]]:
    return [[rng.randrange(10, vocab) for _ in range(128)] for _ in range(k)]


def run(bg: BatchGenerator, steps: int, slow: list, label: str, times: list[float]) -> None:
    global seen
    for _ in range(steps):
        t = clock()
        bg.next()
        ms = (clock() - t) * 1000
        times.append(ms)
        now = modules()
        new = sorted(now - seen)
        seen = now | seen
        if ms > 200 or new:
            caches = bg._generation_batch.prompt_cache
            c = caches[0] if caches else None
            slow.append((label, len(times), round(ms), getattr(c, "_idx", None),
                         None if c is None or c.keys is None else c.keys.shape[2], new))


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
            run(bg, 250, slow, "after removal", times)  # past the trimmed buffer's end
        bg.close()
        times.sort()
        print(f"B={b} {scenario}: median {times[len(times) // 2]:.1f} ms, "
              f"slow or compiling steps (phase, step, ms, position, buffer, modules): {slow}", flush=True)
