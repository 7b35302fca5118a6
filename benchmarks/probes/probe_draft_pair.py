"""Probe (GPU): what a target and its draft model cost step by step, and what greedy
speculation over the pair can give at best, outside the engine.

    PYTHONPATH=. python benchmarks/probes/probe_draft_pair.py TARGET DRAFT [--ks 3,4]
        [--tokens 256] [--rounds 2] [--prompt "..."]

Both models are loaded with mlx-lm's `load`; one chat prompt is prefilled into each.
Per round, timed on the device (medians over the steps):

- `target` / `draft`: a plain greedy step at one row, pipelined as mlx-lm's
  `generate_step` does (step k+1 evaluated asynchronously before step k's token is read);
- `verify K`: the target's forward over K+1 tokens, evaluated and trimmed off again;
- `drafts K`: K greedy draft steps chained on the device (each `async_eval`ed as it is
  built), then evaluated and trimmed off again;
- `lean K`: greedy speculation with K drafts a step, as lean as it goes: the drafts chained
  from the pending token, one forward verifying them, the argmax at every position, one
  read of drafts and targets, both caches trimmed past the first rejected draft. Its
  tokens/s against `target`'s, and the fraction of drafts kept, say what the pair can give
  a single user at best: the engine's speculative step (`_spec_step.py`) adds its policy,
  sampling and bookkeeping to this.

Each of `verify`, `drafts` and `lean` runs twice: with mlx-lm's attention as it is (`fused`:
on CUDA, several queries go to cuDNN, which builds a graph for every pair of query and key
lengths it meets, so `lean`'s first round pays for those graphs and later rounds, at the
same lengths, do not), and with the engine's (`few`: `_shapes.few_queries`, several queries
attending as matmuls, as the engine's speculative step attends).

The greedy tokens of `lean` must equal the target's plain ones (checked; a mismatch is
printed, as bfloat16 forwards over several tokens may round differently from one).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from trio_mlx.actor._shapes import few_queries

PROMPT = ("Write a detailed explanation of how a hash table works, with its collision handling, "
          "resizing, and an example in Python.")


def prefill(model: Any, tokens: list[int]) -> list[Any]:
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def trim(cache: list[Any], n: int) -> None:
    for c in cache:
        c.trim(n)


def plain(model: Any, tokens: list[int], steps: int) -> tuple[float, list[int]]:
    """Pipelined greedy steps: ms a step (median of the second half's per-step times), tokens."""
    cache = prefill(model, tokens[:-1])
    y = mx.array(tokens[-1:])

    def step(y: Any) -> Any:
        return mx.argmax(model(y[None], cache=cache)[0, -1], axis=-1, keepdims=True)

    y = step(y)
    mx.async_eval(y)
    out, times = [], []
    t = time.perf_counter()
    for _ in range(steps):
        nxt = step(y)
        mx.async_eval(nxt)
        out.append(y.item())
        now = time.perf_counter()
        times.append(now - t)
        t = now
        y = nxt
    mx.eval(y)
    return 1e3 * statistics.median(times[steps // 2:]), out


def verify_ms(model: Any, tokens: list[int], k: int, reps: int = 20) -> float:
    cache = prefill(model, tokens)
    x = mx.array(tokens[-(k + 1):])[None]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(mx.argmax(model(x, cache=cache)[0], axis=-1))
        times.append(time.perf_counter() - t)
        trim(cache, k + 1)
    return 1e3 * statistics.median(times[2:])


def drafts_ms(model: Any, tokens: list[int], k: int, reps: int = 20) -> float:
    cache = prefill(model, tokens)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x = mx.array(tokens[-1:])
        for _ in range(k):
            x = mx.argmax(model(x[None], cache=cache)[0, -1], axis=-1, keepdims=True)
            mx.async_eval(x)
        mx.eval(x)
        times.append(time.perf_counter() - t)
        trim(cache, k)
    return 1e3 * statistics.median(times[2:])


def lean(target: Any, draft: Any, tokens: list[int], k: int, n: int) -> tuple[float, float, list[int]]:
    """Greedy speculation, K drafts a step, until n tokens: (ms a token, drafts kept, tokens)."""
    tc, dc = prefill(target, tokens[:-1]), prefill(draft, tokens[:-1])
    pending = tokens[-1]  # on the host: the target's next input
    unfed: list[int] = []  # tokens the draft's cache lacks, before the pending one
    out: list[int] = []
    drafted = kept = 0
    t0 = time.perf_counter()
    while len(out) < n:
        x = mx.array(unfed + [pending])
        ds = []
        for _ in range(k):
            x = mx.argmax(draft(x[None], cache=dc)[0, -1], axis=-1, keepdims=True)
            mx.async_eval(x)
            ds.append(x)
        d = mx.concatenate(ds)
        inputs = mx.concatenate([mx.array([pending]), d])
        targets = mx.argmax(target(inputs[None], cache=tc)[0], axis=-1)
        both = mx.concatenate([d, targets]).tolist()
        dl, tl = both[:k], both[k:]
        a = 0
        while a < k and dl[a] == tl[a]:
            a += 1
        drafted += k
        kept += a
        out.extend(dl[:a] + [tl[a]])  # the kept drafts, then the target's own next token
        # the target took pending and k drafts and keeps pending and a of them
        trim(tc, k - a)
        # the draft took unfed, pending and drafts 1..k-1; it keeps pending and a drafts
        fed_drafts = k - 1
        if a <= fed_drafts:
            trim(dc, fed_drafts - a)
            unfed = []
        else:  # every draft kept: the last one never went into the draft's cache
            unfed = [dl[k - 1]]
        pending = tl[a]
    seconds = time.perf_counter() - t0
    return 1e3 * seconds / len(out), kept / max(1, drafted), out[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("draft")
    ap.add_argument("--ks", default="3,4")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", default=PROMPT)
    a = ap.parse_args()
    target, tok = load(a.target)
    draft, _ = load(a.draft)
    tokens = tok.apply_chat_template([{"role": "user", "content": a.prompt}], add_generation_prompt=True)
    ks = [int(k) for k in a.ks.split(",")]
    plain(target, tokens, 16)
    plain(draft, tokens, 16)  # kernels built
    for r in range(a.rounds):
        t_ms, ref = plain(target, tokens, a.tokens)
        d_ms, _ = plain(draft, tokens, a.tokens)
        print(f"round {r}: target {t_ms:.2f} ms/step ({1e3 / t_ms:.0f} tok/s), draft {d_ms:.2f} ms/step", flush=True)
        for k, attention in ((k, attention) for k in ks for attention in ("few", "fused")):
            with few_queries(True) if attention == "few" else contextlib.nullcontext():
                v, dr = verify_ms(target, tokens, k), drafts_ms(draft, tokens, k)
                ms, acc, out = lean(target, draft, tokens, k, a.tokens)
            same = next((i for i, (x, y) in enumerate(zip(out, ref, strict=False)) if x != y), len(ref))
            print(f"  K={k} {attention:5s}: verify {v:.2f} ms, drafts {dr:.2f} ms, lean {ms:.2f} ms/token "
                  f"({1e3 / ms:.0f} tok/s, {t_ms / ms:.2f}x target), kept {acc:.2f}, "
                  f"the first {same}/{len(ref)} tokens as plain's", flush=True)


if __name__ == "__main__":
    main()
