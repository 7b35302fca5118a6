"""Probe: where a speculative step of several rows spends its time, and what its attention
costs by the way it is called.

    PYTHONPATH=. python benchmarks/probes/probe_verify_phases.py MODEL_DIR [--rows 4] [--tokens 160]

On an H200 a speculative step of four rows (random bf16 1B shape) took ~40 ms against
~4.5 ms for a plain step of the same rows. Two parts:

1. `attention`: MLX's fused attention alone, on the 1B shape's heads (32 queries, 8 keys,
   64 dims, bf16), at key lengths growing by 5 a step as a decode's do (keys and values
   sliced from a longer buffer, as a KV cache hands them over), each call evaluated and
   timed: one query with the batch's array mask (a plain step), 5 queries one at a time
   with slices of the mask (a speculative step before `_shapes.few_queries`), 5 queries
   in one call with the mask, 5 queries as matmuls (`_shapes.attention`, what
   `few_queries` runs), and 5 queries one row and one query at a time over the row's own
   keys, with no mask. Each variant's result is checked against the one call's first.
2. `steps`: the actor itself (as `probe_plain_with_drafter.py` drives it), prompt lookup
   on, one row and `--rows` greedy rows of different prompt lengths (so the batch has
   left padding), biased to repeat one token so that every row drafts: each speculative
   step's wall time (`WidthJudge.record`), with the verify attending query by query (as
   before `few_queries`) and as matmuls, in alternating order; then with the device
   synchronized after each phase of the step (the forward, each row's verify, the
   rollback) to say which costs.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from trio_mlx.actor import ActorConfig, ActorTuning, SamplingParams, Submit, _shapes, _spec_step
from trio_mlx.actor._actor import Actor
from trio_mlx.actor._batch import CausalPrefill
from trio_mlx.actor._decode import Decoder
from trio_mlx.actor._shapes import FEW_QUERIES
from trio_mlx.actor._shapes import attention as matmul_attention
from trio_mlx.actor._speculate import WidthJudge


def _timed(f: Any) -> float:
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(f())
    return (time.perf_counter() - t0) * 1000


def attention(rows: int, rounds: int) -> None:
    h, hkv, d, q_len = 32, 8, 64, 5
    scale = d ** -0.5
    sdpa = mx.fast.scaled_dot_product_attention
    pads = [0, 7, 3, 12][:rows] + [5] * max(0, rows - 4)

    def variants(q: Any, k: Any, v: Any, kl: int) -> dict[str, Any]:
        pos = mx.arange(kl)
        pad = mx.array(pads)[:, None, None, None]
        qpos = mx.arange(kl - q_len, kl)[None, None, :, None]
        mask = (pos[None, None, None, :] >= pad) & (pos[None, None, None, :] <= qpos)  # (rows, 1, q, kl)

        def by_query() -> Any:
            outs = []
            for i in range(q_len):
                end = kl - (q_len - 1 - i)
                outs.append(sdpa(q[:, :, i:i + 1], k[:, :, :end], v[:, :, :end], scale=scale,
                                 mask=mask[..., i:i + 1, :end]))
            return mx.concatenate(outs, axis=2)

        def unfused() -> Any:
            return matmul_attention(q, k, v, scale, mask)

        def per_row() -> Any:
            out = []
            for r in range(rows):
                qs = []
                for i in range(q_len):
                    end = kl - (q_len - 1 - i)
                    qs.append(sdpa(q[r:r + 1, :, i:i + 1], k[r:r + 1, :, pads[r]:end], v[r:r + 1, :, pads[r]:end],
                                   scale=scale))
                out.append(mx.concatenate(qs, axis=2))
            return mx.concatenate(out, axis=0)

        return {
            "mask": mask,
            "plain (1 query, mask)": lambda: sdpa(q[:, :, -1:], k, v, scale=scale, mask=mask[..., -1:, :]),
            "query by query, mask": by_query,
            "one call, mask": lambda: sdpa(q, k, v, scale=scale, mask=mask),
            "matmuls (few_queries)": unfused,
            "row by row, no mask": per_row,
        }

    times: dict[str, list[float]] = collections.defaultdict(list)
    firsts: dict[str, list[float]] = collections.defaultdict(list)
    kl = 300
    for _ in range(rounds):
        kl += 5
        q = mx.random.normal((rows, h, q_len, d)).astype(mx.bfloat16)
        # keys and values as a KV cache hands them over: the first kl positions of its buffer
        kbuf, vbuf = (mx.random.normal((rows, hkv, 512, d)).astype(mx.bfloat16) for _ in range(2))
        mx.eval(q, kbuf, vbuf)
        k, v = kbuf[:, :, :kl], vbuf[:, :, :kl]
        fs = variants(q, k, v, kl)
        ref = fs["one call, mask"]().astype(mx.float32)
        for name in ("query by query, mask", "matmuls (few_queries)", "row by row, no mask"):
            err = mx.abs(fs[name]().astype(mx.float32) - ref).max().item()
            assert err < 0.05, (name, err)
        del fs["mask"]
        for name, f in fs.items():
            first = _timed(f)
            again = _timed(f)
            firsts[name].append(first)
            times[name].append(again)
    print(f"== attention, {rows} rows, {h}/{hkv} heads, {q_len} queries, key lengths 305..{kl}")
    for name in times:
        print(f"  {name:24s} first at a new key length p50 {statistics.median(firsts[name]):8.3f} ms "
              f"max {max(firsts[name]):8.3f}; again p50 {statistics.median(times[name]):7.3f} ms")


def _by_query(sdpa: Any, queries: Any, keys: Any, values: Any, *, scale: float, mask: Any = None,
              sinks: Any = None, **kwargs: Any) -> Any:
    """A speculative step's attention before `_shapes.few_queries` took matmuls: one query at
    a time through the fused attention (what `few_queries` still does past FEW_SCRATCH)."""
    causal = isinstance(mask, str) and mask == "causal"
    if (not 1 < queries.shape[2] <= FEW_QUERIES or sinks is not None or kwargs
            or not (causal or mask is None or isinstance(mask, mx.array))):
        return sdpa(queries, keys, values, scale=scale, mask=mask, sinks=sinks, **kwargs)
    return _shapes._by_query(sdpa, queries, keys, values, scale, mask, causal)


def steps(path: Path, rows: int, tokens: int, synced: bool, variant: str = "matmuls") -> None:
    a = Actor(ActorConfig(model_path=path, tuning=ActorTuning(warmup=False, admit_window=0.0, speculative="ngram")),
              link=type("L", (), {"built": lambda self: None})())  # type: ignore[arg-type]
    a._load()
    record = WidthJudge.record
    log: list[tuple[int, float, int]] = []
    phases: dict[str, list[float]] = collections.defaultdict(list)

    def logged(self: Any, width: int, seconds: float, toks: int, plain: Any) -> None:
        log.append((width, seconds * 1000, toks))
        record(self, width, seconds, toks, plain)

    WidthJudge.record = logged  # type: ignore[method-assign]
    originals = (CausalPrefill.verify, Decoder.verify, _spec_step.rollback)
    few = _shapes._few
    if variant == "query by query":
        _shapes._few = _by_query
    if synced:
        def phase(name: str, f: Any) -> Any:
            def run(*args: Any, **kw: Any) -> Any:
                mx.synchronize()
                t0 = time.perf_counter()
                out = f(*args, **kw)
                mx.eval(out if not isinstance(out, tuple) else [x for x in out if x is not None and not hasattr(x, "arrays")])
                if f is _spec_step.rollback:
                    mx.eval([c.keys for c in args[0] if c.keys is not None])
                mx.synchronize()
                phases[name].append((time.perf_counter() - t0) * 1000)
                return out
            return run
        CausalPrefill.verify = phase("forward", CausalPrefill.verify)  # type: ignore[method-assign]
        Decoder.verify = phase("verify a row", Decoder.verify)  # type: ignore[method-assign]
        _spec_step.rollback = phase("rollback", _spec_step.rollback)
    try:
        top = min(30000, a._vocab)  # ordinary ids (an id past the embedding crashes the CPU build)
        token = top // 2
        subs = [Submit(i + 1, tuple((top // 3 + 31 * i + j) % top for j in range(100 + 9 * i)), tokens,
                       SamplingParams(temperature=0.0, logit_bias=((token, 100.0),)), frozenset())
                for i in range(rows)]
        commands: list[Any] = list(subs)
        wall: list[float] = []
        while True:
            t0 = time.perf_counter()
            failed = a._apply(commands)
            report = a._step(failed or [])
            wall.append((time.perf_counter() - t0) * 1000)
            assert not report.failed, report.failed
            commands = []
            if not a.schedule.seqs:
                break
    finally:
        WidthJudge.record = record  # type: ignore[method-assign]
        CausalPrefill.verify, Decoder.verify, _spec_step.rollback = originals  # type: ignore[method-assign]
        _shapes._few = few
    by_width: dict[int, list[float]] = collections.defaultdict(list)
    for w, ms, _ in log:
        by_width[w].append(ms)
    print(f"== steps ({variant}), {rows} rows, {tokens} tokens, {'synchronized after each phase' if synced else 'as run'}: "
          f"{len(wall)} steps, {len(log)} speculative, step p50 {statistics.median(wall):.2f} ms")
    for w, ms in sorted(by_width.items()):
        print(f"  width {w}: {len(ms)} speculative steps, p50 {statistics.median(ms):.2f} ms, "
              f"first ten {' '.join(f'{x:.1f}' for x in ms[:10])}")
    for name, ms in phases.items():
        print(f"  {name:14s} {len(ms)} calls, p50 {statistics.median(ms):.2f} ms, max {max(ms):.2f}")


def one_query(rows: int, steps: int) -> None:
    """A plain decode step's attention (one query a row), key lengths growing by one: with no
    mask (a batch without left padding), and with the batch's left padding as an array mask."""
    h, hkv, d = 32, 8, 64
    sdpa = mx.fast.scaled_dot_product_attention
    times: dict[str, list[float]] = collections.defaultdict(list)
    kbuf, vbuf = (mx.random.normal((rows, hkv, 512, d)).astype(mx.bfloat16) for _ in range(2))
    q = mx.random.normal((rows, h, 1, d)).astype(mx.bfloat16)
    mx.eval(q, kbuf, vbuf)
    for kl in range(300, 300 + steps):
        k, v = kbuf[:, :, :kl], vbuf[:, :, :kl]
        mask = (mx.arange(kl)[None] >= (mx.arange(rows) % 13)[:, None])[:, None, None, :]
        mx.eval(mask)
        for name, m in (("no mask", None), ("array mask", mask)):
            def f(k: Any = k, v: Any = v, m: Any = m) -> Any:
                return sdpa(q, k, v, scale=0.125, mask=m)
            _timed(f)
            times[name].append(_timed(f))
    print(f"== one query a row, {rows} rows, key lengths 300..{300 + steps - 1}: " + ", ".join(
        f"{name} p50 {statistics.median(ms):.3f} ms" for name, ms in times.items()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", type=Path)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=160)
    p.add_argument("--attention-steps", type=int, default=12)
    p.add_argument("--one-query", action="store_true", help="only a plain step's attention, masked or not")
    args = p.parse_args()
    if args.one_query:
        for rows in (1, 4, 64):
            one_query(rows, 12)
        return
    attention(args.rows, args.attention_steps)
    attention(1, args.attention_steps)
    for rows in (1, args.rows):
        for variant in ("query by query", "matmuls", "matmuls", "query by query"):
            steps(args.model, rows, args.tokens, False, variant)
    steps(args.model, args.rows, args.tokens, True, "query by query")
    steps(args.model, args.rows, args.tokens, True)


if __name__ == "__main__":
    main()
