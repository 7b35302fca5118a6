"""Probe: what handing a batch's grammar bitmasks to the device costs the host each step.

    python benchmarks/probes/probe_mask_upload.py [--rows 64] [--vocab 49152] [--steps 400] [--rounds 3]

The decode step fills its constrained rows' masks into a numpy bitmask (llguidance's layout,
(rows, vocab/32) words) and gives MLX a copy (`mx.array(bitmask)`, `_decode.Decoder._mask_array`).
On CUDA, MLX's buffers are managed memory: a copy lands in a buffer recycled from one the device
used, whose pages may sit on the device, so the host's write may fault them back page by page.
Each step here plays a decode step: a forward-like chain of matmuls over the batch, the masks
applied to its "logits" as the decoder applies them, the argmax started with `mx.async_eval`
before the step before's tokens are read (pipelined), and, between, the host writes the step's
masks (a pattern that changes every step) by one of:

- `copy`: into the numpy bitmask, then `mx.array` of it (the decoder's way);
- `view`: straight into one of two MLX arrays kept for it, through a numpy view of its buffer
  (alternating: the one the last step read may still be read; the one before it was read by a
  step whose tokens were read back since).

Prints, per round and way: the host's ms a step spent handing the masks over, and the whole
step's ms. The ways alternate within each round (the host drifts). Checks that both ways mask
alike (the same tokens every step).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np


def run(way: str, rows: int, words: int, steps: int, weights: list, seed: int) -> tuple[float, float, list[int]]:
    rng = np.random.default_rng(seed)
    host = np.zeros((rows, words), dtype=np.uint32)
    kept = [mx.zeros((rows, words), dtype=mx.uint32) for _ in range(2)]
    mx.eval(*kept)
    views = [np.asarray(memoryview(k)) for k in kept]
    x0 = mx.array(rng.standard_normal((rows, weights[0].shape[0])).astype(np.float32)).astype(mx.bfloat16)
    shifts = mx.arange(32, dtype=mx.uint32)
    pattern = rng.integers(0, 2**32, size=(rows, words), dtype=np.uint32)
    hand, whole, tokens = [], [], []
    prev = None
    for s in range(steps):
        t0 = time.perf_counter()
        h = x0
        for w in weights:
            h = h @ w
        logits = h.astype(mx.float32)
        mx.async_eval(logits)
        t1 = time.perf_counter()
        if way == "copy":
            np.bitwise_xor(pattern, np.uint32(s), out=host)
            masks = mx.array(host)
        else:
            masks = kept[s % 2]
            np.bitwise_xor(pattern, np.uint32(s), out=views[s % 2])
        t2 = time.perf_counter()
        bits = (masks[:, :, None] >> shifts) & 1
        allowed = bits.reshape(rows, -1)[:, : logits.shape[1]] != 0
        tok = mx.argmax(mx.where(allowed, logits, -mx.inf), axis=-1)
        mx.async_eval(tok)
        if prev is not None:
            tokens.extend(prev.tolist())
        prev = tok
        hand.append(t2 - t1)
        whole.append(time.perf_counter() - t0)
    tokens.extend(prev.tolist())
    return statistics.median(hand) * 1e3, statistics.median(whole) * 1e3, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    a = ap.parse_args()
    words = -(-a.vocab // 32)
    rng = np.random.default_rng(0)
    weights = [mx.array(rng.standard_normal((a.hidden, a.hidden)).astype(np.float32) / a.hidden ** 0.5).astype(mx.bfloat16)
               for _ in range(a.layers - 1)]
    weights.append(mx.array(rng.standard_normal((a.hidden, a.vocab)).astype(np.float32)).astype(mx.bfloat16))
    mx.eval(*weights)
    print(f"device {mx.default_device()}, rows {a.rows}, vocab {a.vocab} ({words} words a row, "
          f"{a.rows * words * 4 / 1024:.0f} KiB a step)", flush=True)
    run("copy", a.rows, words, 50, weights, 0)  # warm-up: kernels, buffers
    run("view", a.rows, words, 50, weights, 0)
    for r in range(a.rounds):
        ways = ("copy", "view") if r % 2 == 0 else ("view", "copy")
        got = {w: run(w, a.rows, words, a.steps, weights, r + 1) for w in ways}
        same = got["copy"][2] == got["view"][2]
        print(f"round {r}: " + ", ".join(f"{w} hand-over {got[w][0]:.3f} ms, step {got[w][1]:.3f} ms" for w in ways)
              + f"; same tokens: {same}", flush=True)
        if not same:
            raise SystemExit("the two ways masked differently")


if __name__ == "__main__":
    main()
