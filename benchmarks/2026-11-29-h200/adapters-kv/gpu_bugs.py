"""Which ops fail on CUDA: quantized_matmul as the quantized KV cache's attention calls it, and
the named-adapter forward (every mix of rows), alone and through an engine with its warm-up.

    M=/tmp/m1b [SKIP_QMM=1] PYTHONPATH=. python gpu_bugs.py   (from the repository root)
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import trio
from mlx_lm.models.cache import make_prompt_cache

import trio_mlx
from trio_mlx.models import _models

MODEL = os.environ.get("M", "/tmp/m1b")


def attempt(label: str, fn: Callable[[], Any]) -> None:
    try:
        mx.eval(fn())
        print("ok  ", label, flush=True)
    except Exception as e:
        print("FAIL", label, str(e)[:160], flush=True)


def quantized_matmuls() -> None:
    for d in (64, 128):
        for bits in (4, 8):
            for g in (32, 64, 128):
                if g > d:
                    continue
                for n in (1, 32, 33, 256):
                    for length in (1, 5):
                        q = mx.random.normal((1, 8, length, d)).astype(mx.bfloat16)
                        k = mx.random.normal((1, 8, n, d)).astype(mx.bfloat16)
                        kq = mx.quantize(k, group_size=g, bits=bits)
                        p = mx.softmax(mx.random.normal((1, 8, length, n)).astype(mx.bfloat16), axis=-1)
                        shape = f"d={d} bits={bits} g={g} keys={n} L={length}"
                        attempt(f"qk {shape}", lambda q=q, kq=kq, g=g, bits=bits: mx.quantized_matmul(
                            q, *kq, transpose=True, group_size=g, bits=bits))
                        attempt(f"pv {shape}", lambda p=p, kq=kq, g=g, bits=bits: mx.quantized_matmul(
                            p, *kq, transpose=False, group_size=g, bits=bits))


def adapter_forwards(names: dict[str, str]) -> None:
    model, _ = _models.load_model(MODEL, None, names)
    rows = model._trio_adapter_rows
    cases = (("none B1 L1", [0], 1), ("none B1 L8", [0], 8), ("one B1 L1", [1], 1), ("one B1 L8", [1], 8),
             ("mix B2 L1", [1, 2], 1), ("mix B2 L8", [0, 1], 8), ("mix B4 L1", [0, 1, 2, 1], 1),
             ("mix B2 L128", [1, 0], 128), ("mix B3 L128", [1, 0, 2], 128))
    for label, slots, length in cases:
        def forward(slots: list[int] = slots, length: int = length) -> Any:
            rows.set(slots)
            y = model(mx.array([[5 + i for i in range(length)]] * len(slots)), cache=make_prompt_cache(model))
            rows.clear()
            return y
        attempt("adapters " + label, forward)
    for b, length in ((2, 1), (2, 8), (4, 1), (2, 64), (3, 128), (2, 512)):
        x = mx.random.normal((b, length, 2048)).astype(mx.bfloat16)
        a = mx.random.normal((3, 2048, 16)).astype(mx.bfloat16)
        idx = mx.array([i % 3 for i in range(b)], dtype=mx.uint32)
        attempt(f"gather_mm B={b} L={length}", lambda x=x, a=a, idx=idx: mx.gather_mm(x, a, rhs_indices=idx))
        attempt(f"take+matmul B={b} L={length}", lambda x=x, a=a, idx=idx: x @ a[idx])


async def engine(names: dict[str, str], warmup: bool) -> None:
    try:
        async with trio_mlx.open_engine(MODEL, adapters=names, warmup=warmup, max_batch=4) as eng:
            async def one(adapter: str | None) -> None:
                async with eng.generate("hello there", max_tokens=8, temperature=0.0, ignore_eos=True,
                                        adapter=adapter) as events:
                    async for _ in events:
                        pass
            for plan in ([None], ["a"], ["a", "b"], [None, "a", "b", None]):
                async with trio.open_nursery() as n:
                    for adapter in plan:
                        n.start_soon(one, adapter)
                print(f"ok   engine warmup={warmup} plan={plan}", flush=True)
    except Exception as e:
        print(f"FAIL engine warmup={warmup} {e!r:.400}", flush=True)


def main() -> None:
    if not os.environ.get("SKIP_QMM"):
        quantized_matmuls()
    sys.path.insert(0, "benchmarks/probes")
    from probe_adapters import make_adapters

    names = make_adapters(MODEL, pathlib.Path(tempfile.mkdtemp()), 16)
    adapter_forwards(names)
    trio.run(engine, names, True)


if __name__ == "__main__":
    main()
