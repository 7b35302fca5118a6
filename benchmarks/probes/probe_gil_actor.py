"""Probe (CPU): what the event loop's work per token costs a thread actor that holds the GIL
part of each step, with no GPU and no MLX.

    PYTHONPATH=. python benchmarks/probes/probe_gil_actor.py MODEL_DIR [--build-ms 0.95]
        [--device-ms 1.4] [--concurrency 1,8] [--tokens 256] [--requests 4] [--rounds 2]

A stand-in actor (`FakeActor`, the real actor's schedule and link) whose every step holds
the GIL for `--build-ms` (pure Python, as the actor building a step's graph), calls the
link's `built` (as the real actor does when the model's forward returns), then releases
the GIL for `--device-ms` (a sleep, as MLX encoding, launching and waiting for the
device). Defaults: the H200's one-row step of the 1B shape, `fwd_build` 0.95 ms and
`async_eval` 1.37 ms (benchmarks/2026-11-29-h200/step-phases/). Its ideal is one step per
build + device. Each level is served three ways, in this process's trio run, and each
gets the actor's steps per second against that ideal:
- `alone`: the actor decodes with nothing reading its tokens but the engine's registry
  (the requests' streams are read by one task that does nothing else);
- `engine`: each request read through `engine.generate` (detokenized, stop strings);
- `http`: the server's app under hypercorn, each request streamed over SSE to a client in
  another process (raw sockets, so its parsing costs this process nothing).
The event loop's CPU per token (`time.thread_time` on the trio thread) is printed too.
The model directory gives the tokenizer only. Only ratios within one run mean anything:
the machine's other load moves them all.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import hypercorn.trio
import trio
from hypercorn.config import Config

from trio_mlx import Engine, open_engine
from trio_mlx.actor import FakeActor
from trio_mlx.server._app import create_app
from trio_mlx.server._settings import Settings

CLIENT = r"""
import json, sys, trio

async def one(port, body):
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    await stream.send_all(head + body)
    buf = bytearray()
    while not buf.endswith(b"\r\n0\r\n\r\n"):
        data = await stream.receive_some(1 << 16)
        if not data:
            break
        buf += data
    await stream.aclose()
    return buf.count(b"data: ")

async def main(port, concurrency, per_stream, tokens):
    events = [0]
    async def worker(w):
        for r in range(per_stream):
            body = json.dumps({"prompt": f"stream {w} request {r}", "max_tokens": tokens, "stream": True,
                               "ignore_eos": True}).encode()
            events[0] += await one(port, body)
    async with trio.open_nursery() as nursery:
        for w in range(concurrency):
            nursery.start_soon(worker, w)
    print(json.dumps({"events": events[0]}))

trio.run(main, *map(int, sys.argv[1:]))
"""


class GilActor(FakeActor):
    """FakeActor whose step holds the GIL `build` seconds, says `built`, then sleeps `device`."""

    def __init__(self, *args: Any, build: float, device: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.build, self.device = build, device
        self.timed: list[float] = []  # each decode step's start, on the actor's clock

    def _step(self, new: list[int]) -> Any:
        if self.schedule.seqs:
            self.timed.append(time.perf_counter())
            end = time.perf_counter() + self.build
            while time.perf_counter() < end:  # pure Python: the GIL held, as building a graph
                pass
            self._link.built()
            time.sleep(self.device)  # the GIL released: MLX encoding, launching, waiting
        return super()._step(new)


def _options(build: float, device: float, max_batch: int, actors: list[GilActor]) -> dict[str, Any]:
    def make(config: Any, link: Any) -> GilActor:
        actor = GilActor(config, link, build=build, device=device)
        actors.append(actor)
        return actor

    return dict(actor=make, max_batch=max_batch, warmup=False, restart_limit=0)


def _rate(actor: GilActor, t0: float, t1: float) -> float:
    steps = [t for t in actor.timed if t0 <= t <= t1]
    return (len(steps) - 1) / (steps[-1] - steps[0]) if len(steps) > 1 else 0.0


async def _level(mode: str, model: str, c: int, tokens: int, requests: int, build: float, device: float) -> dict:
    actors: list[GilActor] = []
    options = _options(build, device, max(c, 1), actors)
    if mode == "http":
        settings = Settings.from_env({}, model=model, actor="thread", warmup=False, max_batch=max(c, 1))
        app = create_app(settings, engine_factory=lambda s: Engine(s.model, **options))
        app.on_fatal = lambda *a: None  # type: ignore[method-assign]
        config = Config()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(hypercorn.trio.serve, app, config, shutdown_trigger=stop.wait))
            port = int(binds[0].rsplit(":", 1)[1])
            engine = app.engine
            assert engine is not None
            stats0 = engine.statistics().generated_tokens
            cpu0, t0 = time.thread_time(), time.perf_counter()
            await trio.run_process([sys.executable, "-c", CLIENT, str(port), str(c), str(requests), str(tokens)],
                                   capture_stdout=True)
            cpu, t1 = time.thread_time() - cpu0, time.perf_counter()
            generated = engine.statistics().generated_tokens - stats0
            stop.set()
    else:
        async with open_engine(model, **options) as engine:
            async def worker(w: int) -> None:
                for r in range(requests):
                    async with engine.generate(f"stream {w} request {r}", max_tokens=tokens,
                                               ignore_eos=True) as events:
                        if mode == "engine":
                            async for _ in events:
                                pass
                        else:
                            await events.wait_ended()

            stats0 = engine.statistics().generated_tokens
            cpu0, t0 = time.thread_time(), time.perf_counter()
            async with trio.open_nursery() as nursery:
                for w in range(c):
                    nursery.start_soon(worker, w)
            cpu, t1 = time.thread_time() - cpu0, time.perf_counter()
            generated = engine.statistics().generated_tokens - stats0
    rate = _rate(actors[0], t0, t1)
    return {"mode": mode, "c": c, "steps_per_s": rate, "of_ideal": rate * (build + device),
            "loop_us_per_token": 1e6 * cpu / max(generated, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--build-ms", type=float, default=0.95)
    ap.add_argument("--device-ms", type=float, default=1.4)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    build, device = args.build_ms / 1e3, args.device_ms / 1e3
    print(f"build {args.build_ms} ms, device {args.device_ms} ms: ideal {1 / (build + device):.0f} steps/s; "
          f"switch interval {sys.getswitchinterval() * 1e3:.2f} ms at start")
    for r in range(args.rounds):
        for c in (int(x) for x in args.concurrency.split(",")):
            modes = ("alone", "engine", "http") if r % 2 == 0 else ("http", "engine", "alone")
            for mode in modes:
                res = trio.run(_level, mode, str(Path(args.model)), c, args.tokens, args.requests, build, device)
                print(json.dumps({"round": r, **{k: round(v, 3) if isinstance(v, float) else v
                                                 for k, v in res.items()}}), flush=True)


if __name__ == "__main__":
    main()
