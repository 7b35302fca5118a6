"""Probe (GPU investigation): what a prefill's attention mask costs, array or "causal".

    python benchmarks/probes/probe_prefill_mask.py MODEL_DIR [REPEATS]

mlx_lm's `BatchKVCache.make_mask` always hands the model an array mask (the
left padding of a batch), and MLX's fused attention may not take an array
mask for a prefill, so each step would materialize its scores. When no row of
the prompt batch is left-padded, `mask="causal"` is the same mask. Times one
prefill step of the model, array mask against "causal", for: a fresh prompt
of 1,208 tokens, a 1,500-token prompt behind a 6,000-token cached prefix (a
chat's follow-up), and 8 rows of 512 behind 6,000 each. Prints the median
ms of each and the largest difference between the two ways' last logits.
"""
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from trio_mlx.models import load_model

path = sys.argv[1]
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 7
model, config = load_model(path)
layers = int(config["num_hidden_layers"])
vocab = int(config["vocab_size"])


def caches(rows: int, prefix: int) -> list[BatchKVCache]:
    cs = [BatchKVCache([0] * rows) for _ in range(layers)]
    done = 0
    while done < prefix:
        n = min(2048 // rows, prefix - done)  # one step's scores stay small
        model(mx.random.randint(0, vocab, (rows, n), key=mx.random.key(done)), cache=cs)
        mx.eval([c.state for c in cs])
        done += n
    return cs


def run(rows: int, prefix: int, new: int, causal: bool) -> tuple[float, mx.array]:
    cs = caches(rows, prefix)
    if causal:
        cs[0].make_mask = lambda n, return_array=False, **kw: "causal"  # type: ignore[method-assign]
    tokens = mx.random.randint(0, vocab, (rows, new), key=mx.random.key(1))
    mx.synchronize()
    t0 = time.perf_counter()
    out = model(tokens, cache=cs)[:, -1, :]
    mx.eval(out)
    mx.synchronize()
    dt = time.perf_counter() - t0
    del cs
    mx.clear_cache()
    return dt, out


for rows, prefix, new in ((1, 0, 1208), (1, 6000, 1500), (8, 6000, 512), (1, 0, 2048)):
    times: dict[bool, list[float]] = {False: [], True: []}
    last: dict[bool, mx.array] = {}
    for i in range(repeats + 1):
        for causal in (False, True):
            dt, last[causal] = run(rows, prefix, new, causal)
            if i:  # the first is a compile
                times[causal].append(dt)
    diff = mx.max(mx.abs(last[False].astype(mx.float32) - last[True].astype(mx.float32))).item()
    a, c = statistics.median(times[False]), statistics.median(times[True])
    print(f"rows={rows} prefix={prefix} new={new}: array {1e3 * a:.1f} ms, causal {1e3 * c:.1f} ms "
          f"({a / c:.2f}x); max |logit diff| {diff:.4f}", flush=True)

# Every prompt has its own length: what a prefill of a shape not met before costs (a
# fused kernel may build a plan per shape), each way, on the shapes warmed above.
for causal in (False, True):
    firsts = []
    for i in range(6):
        dt, _ = run(1, 6000 + 37 * i, 1500 + 13 * i + (0 if causal else 7), causal)
        firsts.append(dt)
    print(f"new shapes, {'causal' if causal else 'array'}: " + ", ".join(f"{1e3 * t:.1f}" for t in firsts)
          + " ms", flush=True)
