"""Probe (GPU investigation): what removing rows from a decoding batch costs the host.

    python benchmarks/probes/probe_remove.py MODEL_DIR [ROUNDS]

A BatchGenerator decodes ~64 rows; each round 8 new prompts of 128 tokens
enter, 10 steps decode, then the 8 oldest rows leave and 4 more steps run.
The removal is done two ways in turn: mlx_lm's `BatchGenerator.remove`
(its `BatchKVCache.filter` reads the padding back in every layer) and the
actor's `_remove_rows` (one read for all layers). Prints, per way, the
median ms of the removal call and of the window (removal + 4 steps), and
whether both ways produced the same tokens. benchmarks/2026-11-23-h100/row-removal/README.md
says what it found.
"""
import random
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from trio_mlx.actor._batch import remove_rows as _remove_rows
from trio_mlx.models import load_model

path = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 12
model, config = load_model(path)
vocab = int(config["vocab_size"])
clock = time.perf_counter
WAYS = ("stock", "one read")


def run(way: str, rounds: int, seed: int) -> tuple[list[float], list[float], dict[int, list[int]]]:
    rng = random.Random(seed)
    bg = BatchGenerator(model, max_tokens=10**6, completion_batch_size=256, prefill_batch_size=8,
                        prefill_step_size=2048)
    out: dict[int, list[int]] = {}
    live: list[int] = []

    def step() -> None:
        _, generated = bg.next()
        for r in generated:
            out.setdefault(r.uid, []).append(r.token)

    def enter() -> None:
        live.extend(bg.insert([[rng.randrange(10, vocab) for _ in range(128)] for _ in range(8)]))
        for _ in range(3):  # prefill, then the step that moves the group to decoding
            step()

    for _ in range(8):  # 64 rows
        enter()
    removal, window = [], []
    for _ in range(rounds):
        enter()
        for _ in range(10):
            step()
        gone, live[:] = live[:8], live[8:]
        t0 = clock()
        (bg.remove if way == "stock" else lambda u: _remove_rows(bg, u))(gone)
        t1 = clock()
        for _ in range(4):
            step()
        removal.append((t1 - t0) * 1000)
        window.append((clock() - t0) * 1000)
    bg.close()
    return removal, window, out


results: dict[str, tuple[list[float], list[float]]] = {w: ([], []) for w in WAYS}
tokens: dict[str, dict[int, list[int]]] = {}
run("stock", 2, 99)  # first visits of every shape
for rep in range(3):
    for way in WAYS:
        removal, window, out = run(way, rounds, seed=rep)
        results[way][0].extend(removal)
        results[way][1].extend(window)
        if rep == 0:
            tokens[way] = out
        print(f"rep {rep} {way}: removal p50 {statistics.median(removal):.2f} ms, "
              f"window p50 {statistics.median(window):.2f} ms", flush=True)
for way, (removal, window) in results.items():
    print(f"== {way}: removal p50 {statistics.median(removal):.2f} ms (max {max(removal):.2f}), "
          f"removal + 4 steps p50 {statistics.median(window):.2f} ms, n={len(removal)}")
same = all(tokens[w] == tokens["stock"] for w in WAYS)
print(f"== same tokens in every way: {same}; device {mx.default_device()}")
