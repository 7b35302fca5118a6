"""Probe (GPU, CUDA): one query's attention under an array mask, `_cuda_attention`'s kernel
against MLX's own attention, for a decode step of left-padded rows.

    python benchmarks/probes/probe_masked_decode.py [MODEL_DIR] [--parts check,calls,steps]
        [--rows 4,16,64] [--steps 200] [--rounds 3] [--out RESULTS.json]

check: the kernel against `_shapes.attention` in float32 (MLX's fallback, computed in
float32 from the same inputs) over shapes that vary batch, heads (GQA and not; query
heads per block 1 to 8), head dimension, keys (up to 8k, split across blocks or not;
slices of a longer buffer, as a KV cache hands them), dtype and mask (boolean or additive, per row, per head or broadcast); prints each case's
largest difference and fails past a tolerance. calls: ms per call of the kernel, of
MLX's attention with the mask (its fallback on CUDA) and without (its vector kernel, the
floor), 16 calls per evaluation as a 16-layer step makes. steps (MODEL_DIR): the actor's
owned decode step (`probe_decode_step.py`'s harness) over rows whose prompts differ in
length (64-191 tokens: every step left-padded), the kernel on and off in alternating
rounds: tokens per second and ms per step.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from trio_mlx.actor import _cuda_attention, _shapes


def _kv(b: int, kv: int, t: int, d: int, dtype: Any, spare: int) -> Any:
    """Keys (or values) of `t` positions sliced from a buffer of `t + spare`, as a cache's."""
    return mx.random.normal((b, kv, t + spare, d)).astype(dtype)[:, :, :t]


def _mask(kind: str, b: int, h: int, t: int, dtype: Any) -> Any:
    pad = mx.array([random.randrange(0, max(1, t // 2)) for _ in range(b)])
    keep = mx.arange(t)[None] >= pad[:, None]  # (B, T): each row's left padding
    if kind == "bool":
        return keep[:, None, None, :]
    if kind == "additive":
        return mx.where(keep, 0.0, -mx.inf).astype(dtype)[:, None, None, :]
    if kind == "head":  # a per-head mask: also every third key hidden from odd heads
        hide = (mx.arange(h)[:, None] % 2 == 1) & (mx.arange(t)[None] % 3 == 0)
        m = keep[:, None, :] & ~hide[None]
        return mx.concatenate([mx.ones((b, h, 1), dtype=mx.bool_), m[:, :, 1:]], axis=2)[:, :, None, :]
    if kind == "broadcast":
        return keep[:1, None, None, :]
    raise ValueError(kind)


def check() -> list[dict[str, Any]]:
    random.seed(0)
    mx.random.seed(0)
    cases = [(4, 32, 8, 300, 64), (3, 8, 8, 1000, 128), (2, 16, 4, 4097, 128), (1, 32, 8, 17, 64),
             (64, 32, 8, 333, 64), (5, 8, 2, 8192, 256), (2, 4, 1, 40, 96), (3, 12, 2, 700, 128),
             (2, 28, 4, 513, 128)]
    out, worst = [], 0.0
    for b, h, kv, t, d in cases:
        for dtype in (mx.bfloat16, mx.float16, mx.float32):
            for kind in ("bool", "additive", "head", "broadcast"):
                q = mx.random.normal((b, h, 1, d)).astype(dtype)
                k, v = _kv(b, kv, t, d, dtype, 37), _kv(b, kv, t, d, dtype, 37)
                mask = _mask(kind, b, h, t, dtype)
                scale = d ** -0.5
                assert _cuda_attention.applies(q, k, v, mask), (b, h, kv, t, d, dtype, kind)
                got = _cuda_attention.attention(q, k, v, scale, mask).astype(mx.float32)
                f32 = mask if mask.dtype == mx.bool_ else mask.astype(mx.float32)
                want = _shapes.attention(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32),
                                         scale, f32)
                fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask).astype(mx.float32)
                err = mx.max(mx.abs(got - want)).item()
                err_mlx = mx.max(mx.abs(fused - want)).item()
                tol = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}[dtype]
                ok = err <= max(tol, 2 * err_mlx)
                worst = max(worst, err / tol)
                row = {"b": b, "h": h, "kv": kv, "t": t, "d": d, "dtype": str(dtype), "mask": kind,
                       "kernel_err": err, "mlx_err": err_mlx, "ok": ok}
                out.append(row)
                print(f"check b={b} h={h} kv={kv} t={t} d={d} {str(dtype):14s} {kind:9s} "
                      f"kernel {err:.2e} mlx {err_mlx:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    print(f"check: {sum(r['ok'] for r in out)}/{len(out)} ok, worst {worst:.2f} of tolerance", flush=True)
    return out


def _time(fn: Any, reps: int = 30) -> float:
    for _ in range(3):
        mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return 1e3 * (time.perf_counter() - t0) / reps


def _ways(q: Any, k: Any, v: Any, s: float, mask: Any) -> dict[str, Any]:
    """16 calls (a 16-layer step's) of each way to attend."""
    sdpa = mx.fast.scaled_dot_product_attention
    return {
        "kernel": lambda: [_cuda_attention.attention(q, k, v, s, mask) for _ in range(16)],
        "mlx_masked": lambda: [sdpa(q, k, v, scale=s, mask=mask) for _ in range(16)],
        "mlx_unmasked": lambda: [sdpa(q, k, v, scale=s) for _ in range(16)],
    }


def calls() -> list[dict[str, Any]]:
    out = []
    h, kv, d, dtype = 32, 8, 64, mx.bfloat16  # the 1B shape's attention
    for b in (4, 16, 64):
        for t in (256, 1024, 4096):
            q = mx.random.normal((b, h, 1, d)).astype(dtype)
            k, v = _kv(b, kv, t, d, dtype, 256), _kv(b, kv, t, d, dtype, 256)
            mask = _mask("bool", b, h, t, dtype)
            mx.eval(q, k, v, mask)
            ways = _ways(q, k, v, d ** -0.5, mask)
            row: dict[str, Any] = {"b": b, "t": t}
            for name, fn in ways.items():
                row[name] = _time(fn)
            out.append(row)
            print(f"calls b={b:3d} t={t:5d}: 16 calls kernel {row['kernel']:.3f} ms, mlx masked "
                  f"{row['mlx_masked']:.3f}, mlx unmasked {row['mlx_unmasked']:.3f}", flush=True)
    return out


def steps(model: Path, rows_list: list[int], n_steps: int, rounds: int) -> list[dict[str, Any]]:
    sys.path.insert(0, str(Path(__file__).parent))
    import probe_decode_step as pds  # the actor harness

    from trio_mlx.actor import SamplingParams, Submit

    available = _cuda_attention.available

    def measure(a: Any, rows: int, seed: int) -> dict[str, float]:
        rng = random.Random(seed)
        subs = [Submit(20_000 + i, tuple(rng.randrange(10, a._vocab) for _ in range(rng.randrange(64, 192))),
                       n_steps + 64, SamplingParams(temperature=0.0), frozenset(), None) for i in range(rows)]
        return pds.timed_steps(a, subs, n_steps)

    out = []
    for rows in rows_list:
        a = pds.actor(model, "owned", rows)
        got: dict[str, list[float]] = {"kernel": [], "mlx": []}
        for way in ("kernel", "mlx"):  # untimed: kernels compiled
            _cuda_attention.available = available if way == "kernel" else (lambda: False)  # type: ignore[assignment]
            measure(a, rows, 0)
        for r in range(rounds):
            for way in (("kernel", "mlx") if r % 2 == 0 else ("mlx", "kernel")):
                _cuda_attention.available = available if way == "kernel" else (lambda: False)  # type: ignore[assignment]
                m = measure(a, rows, r + 1)
                got[way].append(m["tok_s"])
                out.append({"rows": rows, "way": way, "round": r, **m})
                print(f"steps rows={rows:3d} {way:6s} round {r}: {m['tok_s']:9.1f} tok/s {m['ms_step']:6.2f} ms/step",
                      flush=True)
        _cuda_attention.available = available  # type: ignore[assignment]
        k, m_ = statistics.median(got["kernel"]), statistics.median(got["mlx"])
        print(f"steps rows={rows:3d}: kernel {k:.1f} tok/s, mlx {m_:.1f} tok/s, kernel/mlx {k / m_:.3f}", flush=True)
        a._free()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, nargs="?")
    p.add_argument("--parts", default="check,calls,steps")
    p.add_argument("--rows", default="4,16,64")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    parts = args.parts.split(",")
    results: dict[str, Any] = {}
    if "check" in parts:
        results["check"] = check()
    if "calls" in parts:
        results["calls"] = calls()
    if "steps" in parts and args.model:
        results["steps"] = steps(args.model, [int(r) for r in args.rows.split(",")], args.steps, args.rounds)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    if "check" in results and not all(r["ok"] for r in results["check"]):
        raise SystemExit("check failed")


if __name__ == "__main__":
    main()
