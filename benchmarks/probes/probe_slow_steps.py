"""Probe (GPU investigation): what the actor does in its slow steps, under cProfile.

    PYTHONPATH=. python benchmarks/probes/probe_slow_steps.py MODEL_DIR [REQUESTS] [--ms 30] [--top 25]
        [--max-tokens 128]

An `Engine` (thread actor, warmed up) serves REQUESTS (default 6) greedy requests one after
another (c=1), 128 random-text tokens in, `--max-tokens` out (`ignore_eos`). Every actor turn
(`Rank.turn`: the commands applied, then the step) runs under its own `cProfile.Profile`;
a turn that took more than `--ms` milliseconds prints its request, its turn number and
its profile's top functions by cumulative time, and the tokens its request had then.
MLX's functions are nanobind objects, which cProfile does not see (their time shows as
their caller's own): `mx.eval`, `mx.async_eval` and `mx.synchronize` are wrapped in Python
functions here so that they show; what remains in a caller's own time is the rest of MLX
(`tolist`, `item`, building the graph). Found on the H200: one turn of 50-500 ms,
CPU-bound, at the end of a process's first measured request; this names what it runs.
Profiling slows every turn (a few times): the turn's share is the figure, not its time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time

import trio

import trio_mlx
from trio_mlx.actor import _rank

slow: list[tuple[int, float, str]] = []  # (turn, ms, profile text)
turns = 0
received = 0  # tokens the current request has received


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("requests", type=int, nargs="?", default=6)
    ap.add_argument("--ms", type=float, default=30.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    import mlx.core as mx

    for name in ("eval", "async_eval", "synchronize"):
        fn = getattr(mx, name)
        setattr(mx, name, (lambda f: lambda *a, **k: f(*a, **k))(fn))
    original = _rank.Rank.turn

    def profiled(self: _rank.Rank, commands: object) -> object:
        global turns
        turns += 1
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        try:
            return original(self, commands)  # type: ignore[arg-type]
        finally:
            prof.disable()
            ms = (time.perf_counter() - t0) * 1e3
            if ms > args.ms and ready:
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.top)
                slow.append((turns, ms, f"(its request had {received} tokens)\n" + out.getvalue()))

    _rank.Rank.turn = profiled  # type: ignore[method-assign]
    ready = False
    rng = random.Random(0)
    words = "alpha beta gamma delta river stone cloud maple orbit lantern".split()

    async def serve() -> None:
        nonlocal ready
        global received
        async with trio_mlx.open_engine(args.model, max_batch=64) as engine:
            ready = True
            for i in range(args.requests):
                before = len(slow)
                prompt = " ".join(rng.choice(words) for _ in range(100))
                t0 = time.perf_counter()
                n = received = 0
                async with engine.generate(prompt, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True) as events:
                    async for ev in events:
                        if isinstance(ev, trio_mlx.TextDelta):
                            n += len(ev.token_ids)
                            received = n
                print(f"request {i}: {n} tokens in {time.perf_counter() - t0:.3f} s, "
                      f"{len(slow) - before} slow turns", flush=True)
                for turn, ms, text in slow[before:]:
                    print(f"--- request {i}, turn {turn}: {ms:.1f} ms\n{text}", flush=True)

    trio.run(serve)


if __name__ == "__main__":
    main()
