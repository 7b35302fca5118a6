"""`trio-mlx bench --engine`: the channel API in-process, no HTTP.

The same prompts and closed loop as `--limit`, but every request goes through
`engine.generate()`: the actor thread, the one crossing per step, the trio
registry and per-request channels. Comparing it with `--limit` (the raw
BatchGenerator) isolates the engine's overhead; comparing the HTTP server
with it isolates HTTP/SSE. The event loop's CPU time (the trio thread only;
the actor runs on its own thread) is reported per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import trio

import trio_mlx

from ._progress import LevelBar, level_label
from ._stats import RequestRecord, check_length, in_process_level


async def _one(engine: trio_mlx.Engine, prompt: Sequence[int], max_tokens: int, rec: RequestRecord) -> None:
    clock = time.perf_counter
    t0 = last = clock()
    async with engine.generate(list(prompt), max_tokens=max_tokens, temperature=0, ignore_eos=True) as events:
        async for ev in events:
            now = clock()
            if isinstance(ev, trio_mlx.TextDelta):
                if rec.ttft is None:
                    rec.ttft = now - t0
                else:
                    rec.itl.append(now - last)
                last = now
                rec.output_tokens += len(ev.token_ids)
                rec.events += 1
            elif isinstance(ev, trio_mlx.Finished):
                rec.finish_reason = ev.finish_reason
                rec.e2e = now - t0
                if ev.finish_reason != "length":
                    rec.error, rec.message = f"finish_{ev.finish_reason}", ev.error
    check_length(rec, max_tokens)


async def _level(engine: trio_mlx.Engine, prompts: Sequence[Sequence[int]], concurrency: int,
                 lengths: Sequence[int]) -> tuple[list[RequestRecord], float]:
    records = [RequestRecord() for _ in prompts]
    todo = iter(range(len(prompts)))
    bar = LevelBar(level_label(concurrency, None), len(prompts))

    async def worker() -> None:
        for i in todo:
            await _one(engine, prompts[i], lengths[i], records[i])
            bar.done(records[i].output_tokens)

    t0 = time.perf_counter()
    with bar:
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
    return records, time.perf_counter() - t0


def run_engine(
    model: str,
    prompts: Sequence[Sequence[int]],
    *,
    warmup: Sequence[Sequence[int]],
    plan: Sequence[tuple[int, int]],
    lengths: Sequence[int],
    tuning: trio_mlx.ActorTuning,
    actor: str = "thread",
    on_level: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    async def main() -> list[dict[str, Any]]:
        levels = []
        async with trio_mlx.open_engine(model, tuning=tuning, max_queue=1 << 20, actor=actor) as engine:
            if warmup:
                await _level(engine, warmup, len(warmup), [4] * len(warmup))
            pos = 0
            for concurrency, n in plan:
                cpu0 = time.thread_time()  # this thread runs the event loop
                records, duration = await _level(engine, prompts[pos : pos + n], concurrency, lengths[pos : pos + n])
                pos += n
                lv = in_process_level(
                    records,
                    duration=duration,
                    concurrency=concurrency,
                    cpu_s=time.thread_time() - cpu0,
                    cpu_name="event_loop",
                )
                levels.append(lv)
                if on_level is not None:
                    on_level(lv)
        return levels

    return trio.run(main)
