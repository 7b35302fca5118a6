"""Probe (distributed): what a per-step command message costs a tensor-parallel decode step.

    mlx.launch --backend nccl -n 2 -- python benchmarks/probes/probe_dist_exchange.py MODEL_DIR
    # two local CPU ranks without the launcher (its I/O threads take a core: docs/distributed.md)
    MLX_HOSTFILE=H MLX_RANK=1 python benchmarks/probes/probe_dist_exchange.py MODEL_DIR &
    MLX_HOSTFILE=H MLX_RANK=0 python benchmarks/probes/probe_dist_exchange.py MODEL_DIR
    # (H: a file holding [["127.0.0.1:5000"], ["127.0.0.1:5001"]])

Every rank loads its shard with mlx-lm's `sharded_load` and runs the same
`BatchGenerator` decode steps in lockstep (no server, no trio), at each batch
width of WIDTHS (default 1,8,64), in ROUNDS (3) rounds of STEPS (150) steps, with
a 1 KiB `all_sum` message per step on the generation stream, as trio_mlx sends
(MODES, default none,before,ahead, picks which):

- none:  no message (the model's own all-reduces only);
- before: rank 0 queues step k's message just before step k and a follower
  waits for it before it builds the step (trio_mlx before 2026-11-24);
- ahead: every rank queues step k+1's message before step k and a follower
  reads it after building step k (what `LeaderActor` does now).

Rank 0 prints, per mode and width, the median ms a step (best round) and the
follower's median wait for its message. ~1 minute for the tiny model on CPU.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, generation_stream

from trio_mlx.actor._distributed import init_group, load_shard

group, backend = init_group()  # the backend mlx.launch set up, as trio-mlx serve picks it
model, _ = load_shard(Path(sys.argv[1]), "tensor", group)  # as a rank of trio-mlx serve loads
lead = group.rank() == 0
widths = [int(w) for w in os.environ.get("WIDTHS", "1,8,64").split(",")]
rounds, steps = int(os.environ.get("ROUNDS", "3")), int(os.environ.get("STEPS", "150"))
mx.random.seed(0)
bg = BatchGenerator(model, max_tokens=1, completion_batch_size=max(widths), prefill_batch_size=8)


def post() -> mx.array:
    with mx.stream(generation_stream):
        out = mx.distributed.all_sum(mx.zeros(1024, dtype=mx.uint8), group=group)
    mx.async_eval(out)
    return out


def run(mode: str, width: int) -> tuple[float, float]:
    step_ms, wait_ms = [], []
    for _ in range(rounds):
        uids = bg.insert([[1 + i % 7] * 32 for i in range(width)], max_tokens=[steps + 40] * width)
        while len(bg.next()[1]) < width:  # prefill first: only decode steps are timed
            pass
        times, waits = [], []
        pending = post() if mode == "ahead" else None
        for _ in range(steps):
            t0 = time.perf_counter()
            wait = 0.0
            if mode == "before":
                message = post()
                if not lead:
                    bytes(np.array(message))
                    wait = time.perf_counter() - t0
            elif mode == "ahead":
                following = post()
            bg.next()
            if mode == "ahead":
                if not lead:
                    t1 = time.perf_counter()
                    bytes(np.array(pending))
                    wait = time.perf_counter() - t1
                pending = following
            times.append(time.perf_counter() - t0)
            waits.append(wait)
        if pending is not None:
            mx.eval(pending)
        bg.remove(uids)
        step_ms.append(statistics.median(times[10:]) * 1e3)
        wait_ms.append(statistics.median(waits[10:]) * 1e3)
    return min(step_ms), statistics.median(wait_ms)


modes = os.environ.get("MODES", "none,before,ahead").split(",")
results = {(mode, w): run(mode, w) for w in widths for mode in modes}
# the followers' waits, to rank 0: an all_sum of each rank's figures, on the model's stream once it
# is done (on another stream it could meet the last step's all-reduces instead of its own)
mx.synchronize()
with mx.stream(generation_stream):
    waits = mx.distributed.all_sum(mx.array([results[k][1] for k in results]), group=group) / (group.size() - 1)
mx.eval(waits)  # on every rank: a collective only one rank evaluates never completes
if lead:
    print(f"{group.size()} ranks over {backend}, {sys.argv[1]}: median ms a step (a follower's median wait for its message)")
    for (mode, w), (step, _), wait in zip(results, results.values(), np.array(waits).tolist(), strict=True):
        print(f"  width {w:3d}  {mode:6s}  {step:7.2f} ms  ({wait:.2f} ms)")
