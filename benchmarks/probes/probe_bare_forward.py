"""Probe (GPU ceiling): MLX's own decode forward, pipelined, with nothing of a server around it.

    python benchmarks/probes/probe_bare_forward.py MODEL_DIR [--rows 1,64] [--steps 200] [--rounds 3]
        [--cache plain,batch,batch-nomask,batch-shared,batch-int,batch-after,batch-padded] [--phases]

For each width B: B rows of 128 random prompt tokens are prefilled into mlx-lm's
plain KV caches, then `steps` greedy decode steps run as mlx-lm's single-stream
`generate_step` runs them: step k+1's forward is built and `mx.async_eval`ed
before step k's tokens are read back. Tokens per second (B x steps / seconds) and
milliseconds per step: the ceiling the actor's decode step is measured against
(issue: at least 0.9x of it at one row). The plain loop is
`trio_mlx.actor._ceiling.bare_level`, the bare ceiling `trio-mlx bench --limit`
reports beside the BatchGenerator's; this probe keeps the variants. `--cache` also runs the same loop over
the caches a batch decodes with: `batch`, mlx-lm's BatchKVCache (no padding:
its decode step then still builds an attention mask and rotates by per-row
offsets), and `batch-nomask`, the same with the mask left out, as a plain
cache has none at one token. Two more split what the batch cache costs beyond its mask:
`batch-shared`, every layer taking the first layer's offset (one addition a step, not one a
layer), and `batch-int`, the offset a Python int (no row is padded, so every row's offset is
the cache's length: RoPE by a scalar offset, as a plain cache's, and no addition at all).
`batch-after` is what the actor does (`_step_caches.share_offsets`): every layer builds its
addition, and after the forward is built every layer is given the first layer's offset, so the
others' additions are never evaluated. `batch-padded` is `batch-after` with the rows left-padded
by 0, 2, 4, ... tokens (rows that entered apart): mlx-lm's array mask at every step, which on
CUDA takes `_cuda_attention.py`'s kernel (`_shapes.few_queries`), as the actor's padded step does.

`--phases` splits each step's wall time on the host: building the graph (the forward and the
argmax), `mx.async_eval` (MLX encoding and launching it), and the read of the step before
(waiting on the device). A step whose read takes nothing is bound by the host.
"""
from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from trio_mlx.actor._ceiling import bare_level
from trio_mlx.actor._shapes import few_queries
from trio_mlx.actor._step_caches import share_offsets
from trio_mlx.models import load_model


class _NoMask(BatchKVCache):
    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return None if N == 1 else super().make_mask(N, return_array=return_array, **kwargs)


class _Shared(_NoMask):
    """Layers after the first take its offset: mlx-lm's models advance every layer's cache
    alike, and the first layer's `update_and_fetch` runs before the others' in a forward."""

    lead: BatchKVCache

    def update_and_fetch(self, keys, values):
        grows = self.keys is None or self._idx + keys.shape[2] > self.keys.shape[2]
        if self.lead is self or grows:
            return super().update_and_fetch(keys, values)
        prev = self._idx
        self.offset = self.lead.offset
        self._idx += keys.shape[2]
        self.keys[..., prev : self._idx, :] = keys
        self.values[..., prev : self._idx, :] = values
        return self.keys_and_values()


def _caches(model, rows: int, kind: str) -> list:
    cls = {"batch": BatchKVCache, "batch-nomask": _NoMask, "batch-shared": _Shared, "batch-int": _NoMask,
           "batch-after": _NoMask, "batch-padded": BatchKVCache}[kind]
    padding = [2 * i for i in range(rows)] if kind == "batch-padded" else [0] * rows
    cache = [cls(padding) for _ in model.layers]
    for c in cache:
        c.lead = cache[0]
        if kind == "batch-int":
            c.offset = 0  # no row padded: the offset is the cache's length, a Python int
    return cache


def run(model, vocab: int, rows: int, steps: int, kind: str = "plain", phases: list | None = None) -> float:
    """The decode steps' seconds; with `phases` (and a batch cache), each step's host seconds
    building, in `async_eval` and reading back are appended to it."""
    if kind == "plain":  # the bench's own bare ceiling: its decode steps' seconds
        prompts = mx.random.randint(0, vocab, (rows, 128)).tolist()
        return bare_level(model, prompts, steps + 1)["decode_s"]
    else:
        cache = _caches(model, rows, kind)
    prompt = mx.random.randint(0, vocab, (rows, 128))
    logits = model(prompt, cache=cache)
    y = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(y)

    def step(tok):
        with few_queries(kind == "batch-padded"):
            out = model(tok[:, None], cache=cache)
        if kind in ("batch-after", "batch-padded"):
            share_offsets(cache)
        return mx.argmax(out[:, -1, :], axis=-1)

    clock = time.perf_counter
    nxt = step(y)
    mx.async_eval(nxt)
    t0 = clock()
    for _ in range(steps):
        cur = nxt
        a = clock()
        nxt = step(cur)
        b = clock()
        mx.async_eval(nxt)
        c = clock()
        cur.tolist()  # the host reads step k while step k+1 computes
        if phases is not None:
            phases.append((b - a, c - b, clock() - c))
    mx.eval(nxt)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache", default="plain")
    ap.add_argument("--phases", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    model, config = load_model(args.model)
    vocab = int(config["vocab_size"])
    results = []
    kinds = args.cache.split(",")
    for rows in (int(r) for r in args.rows.split(",")):
        for kind in kinds:
            run(model, vocab, rows, 20, kind)  # compile this width's kernels
        for rnd in range(args.rounds):
            for kind in kinds if rnd % 2 == 0 else kinds[::-1]:  # the host drifts: alternate
                split: list | None = [] if args.phases and kind != "plain" else None
                secs = run(model, vocab, rows, args.steps, kind, split)
                r = {"rows": rows, "cache": kind, "round": rnd, "tok_s": rows * args.steps / secs,
                     "ms_step": 1e3 * secs / args.steps}
                line = f"rows={rows:4d} {kind:12s} round {rnd}: {r['tok_s']:9.1f} tok/s {r['ms_step']:7.2f} ms/step"
                if split:
                    r["ms_build_eval_read"] = [1e3 * sum(p[i] for p in split) / len(split) for i in range(3)]
                    line += "  build {:.2f} async_eval {:.2f} read {:.2f}".format(*r["ms_build_eval_read"])
                results.append(r)
                print(line, flush=True)
        mx.clear_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
