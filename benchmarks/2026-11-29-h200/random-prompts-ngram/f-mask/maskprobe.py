"""Probe: pipelined one-token decode steps over mlx-lm's model call and a `BatchKVCache`, for B
rows (4, 16, 64) at 256 positions: no row padded and no mask (the actor's `unmask_unpadded`), no
row padded with mlx-lm's array mask, and one row padded by one position (the mask it needs).
`python maskprobe.py MODEL` (from the repository root on the device: i3.sh built /tmp/m1b)."""

import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache

model, _ = load(sys.argv[1])
L = 256


def no_mask(N: int, return_array: bool = False, **kw: object) -> object:
    return None if N == 1 else "causal"


def run(B: int, padding: list[int], nomask: bool, steps: int = 300) -> float:
    cache = [BatchKVCache(padding) for _ in model.layers]
    if nomask:
        for c in cache:
            vars(c)["make_mask"] = no_mask
    model(mx.array([[1 + i for i in range(L)] for _ in range(B)]), cache=cache)
    mx.eval([c.state for c in cache])
    y = mx.array([[5]] * B)
    t0 = time.perf_counter()
    for i in range(steps):
        if i == 20:
            mx.eval(y)
            t0 = time.perf_counter()
        y = mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1, keepdims=True)
        mx.async_eval(y)
    mx.eval(y)
    return (time.perf_counter() - t0) / (steps - 20) * 1e3


for B, r in [(b, r) for b in (4, 16, 64) for r in range(3)]:
    order = [("unpadded, no mask", [0] * B, True), ("unpadded, mask", [0] * B, False),
             ("one row padded, mask", [1] + [0] * (B - 1), False)]
    if r % 2:
        order.reverse()
    for name, pad, nomask in order:
        print(f"B={B}", r, name, f"{run(B, pad, nomask):.3f} ms/step", flush=True)
