"""Probe: a pipelined one-token decode step of 4 rows over a BatchKVCache: no row padded and no\nmask (the actor's `unmask_unpadded`), no row padded with mlx-lm's array mask, one row padded by\none position (the mask it needs); the same KV length."""
import sys, time
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache

model, _ = load(sys.argv[1])
L = 256

def run(B, padding, nomask, steps=300):
    cache = [BatchKVCache(padding) for _ in model.layers]
    if nomask:  # what the actor does where no row is padded (`_batch.unmask_unpadded`)
        for c in cache:
            vars(c)["make_mask"] = lambda N, return_array=False, **kw: None if N == 1 else "causal"
    x = mx.array([[1 + i for i in range(L)] for _ in range(B)])
    model(x, cache=cache)
    mx.eval([c.state for c in cache])
    y = mx.array([[5]] * B)
    t0 = None
    for i in range(steps):
        if i == 20:
            mx.eval(y); t0 = time.perf_counter()
        logits = model(y, cache=cache)[:, -1, :]
        y = mx.argmax(logits, axis=-1, keepdims=True)
        mx.async_eval(y)
    mx.eval(y)
    return (time.perf_counter() - t0) / (steps - 20) * 1e3

for B, r in [(b, r) for b in (4, 16, 64) for r in range(3)]:
    order = [("unpadded, no mask", [0] * B, True), ("unpadded, mask", [0] * B, False),
             ("one row padded, mask", [1] + [0] * (B - 1), False)]
    if r % 2: order.reverse()
    for name, pad, nomask in order:
        print(f"B={B}", r, name, "%.3f ms/step" % run(B, pad, nomask), flush=True)
