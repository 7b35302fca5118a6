"""Probe (GPU): whether a host-bound model's decode steps run slower on a worker thread than
on a process's main thread, and what the engine's switch interval does to them.

    PYTHONPATH=. python benchmarks/probes/probe_thread_steps.py MODEL [--steps 300] [--rounds 3]

MODEL (e.g. `trio-mlx model build --shape smollm2-135m`): one row, greedy, pipelined as
mlx-lm's `generate_step` (step k+1 `async_eval`ed before step k's token is read), the
median ms a step over `--steps`, in each place in turn, every round:

- `main`: this process's main thread;
- `thread`: a `threading.Thread`, the main thread blocked in `join`;
- `trio`: `trio.to_thread.run_sync` (the thread actor's way), the event loop idle;
- `trio-fast`: the same with `sys.setswitchinterval(0.0001)`, as the engine sets it;
- `trio-ticks`: the same, the loop waking every 2 ms for ~50 us of Python (a stand-in
  for an engine's loop taking reports in).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import Any

import mlx.core as mx
import trio
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def steps(model: Any, n: int) -> float:
    cache = make_prompt_cache(model)
    model(mx.arange(1, 65)[None], cache=cache)
    y = mx.array([1])

    def step(y: Any) -> Any:
        return mx.argmax(model(y[None], cache=cache)[0, -1], axis=-1, keepdims=True)

    y = step(y)
    mx.async_eval(y)
    times, t = [], time.perf_counter()
    for _ in range(n):
        nxt = step(y)
        mx.async_eval(nxt)
        y.item()
        now = time.perf_counter()
        times.append(now - t)
        t, y = now, nxt
    return 1e3 * statistics.median(times[n // 4:])


def in_trio(model: Any, n: int, ticks: bool) -> float:
    async def main() -> float:
        async def tick() -> None:
            while True:
                await trio.sleep(0.002)
                t = time.perf_counter()
                while time.perf_counter() - t < 50e-6:
                    pass

        async with trio.open_nursery() as nursery:
            if ticks:
                nursery.start_soon(tick)
            out = await trio.to_thread.run_sync(steps, model, n)
            nursery.cancel_scope.cancel()
        return out
    return trio.run(main)


def in_thread(model: Any, n: int) -> float:
    out: list[float] = []
    t = threading.Thread(target=lambda: out.append(steps(model, n)))
    t.start()
    t.join()
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    model, _ = load(a.model)
    default = sys.getswitchinterval()
    steps(model, 50)
    places = {
        "main": lambda: steps(model, a.steps),
        "thread": lambda: in_thread(model, a.steps),
        "trio": lambda: in_trio(model, a.steps, False),
        "trio-fast": lambda: in_trio(model, a.steps, False),
        "trio-ticks": lambda: in_trio(model, a.steps, True),
    }
    results: dict[str, list[float]] = {k: [] for k in places}
    for r in range(a.rounds):
        order = list(places) if r % 2 == 0 else list(reversed(places))
        for name in order:
            sys.setswitchinterval(0.0001 if name in ("trio-fast", "trio-ticks") else default)
            results[name].append(places[name]())
        print(f"round {r}: " + ", ".join(f"{k} {results[k][-1]:.3f}" for k in places) + " ms/step", flush=True)
    sys.setswitchinterval(default)
    print("medians: " + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in results.items()))


if __name__ == "__main__":
    main()
