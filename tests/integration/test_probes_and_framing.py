"""Smaller hardening: the watchdog after idle, readiness while stalled, ambiguous framing, the listen
backlog, and a bound on what a client that stopped reading leaves buffered. A real hypercorn on
127.0.0.1 each time.

Here the probes and a reader that stopped, on a real model; framing and the backlog:
tests/unit/test_probes_and_framing.py.
"""

from __future__ import annotations

import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from app_server import (
    CHAT,
    COMPLETIONS,
    HELLO,
    engine_factory,
    open_raw,
    serve,
    slow_steps,
    until,
    until_answer,
)

pytestmark = pytest.mark.timeout(60)


async def test_health_counts_from_the_first_work_after_idle(tiny_model_fp32: Path) -> None:
    slow = threading.Event()

    def hook(stage: str) -> None:
        if stage == "step" and slow.is_set():
            time.sleep(0.15)

    async with serve(tiny_model_fp32, watchdog_seconds=0.3, factory=engine_factory(fault_hook=hook)) as server, \
            server.client() as client:
        r = await client.post(CHAT, json={"messages": HELLO, "max_tokens": 2})
        assert r.status_code == 200
        await trio.sleep(0.6)  # idle for twice the watchdog
        slow.set()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(client.post, CHAT, json={"messages": HELLO, "max_tokens": 4}))
            await until(lambda: server.engine.statistics().queued + server.engine.statistics().prefilling
                        + server.engine.statistics().decoding > 0)
            r = await client.get("/health")
            assert r.status_code == 200, r.text  # before: "stalled", counting the idle time
            assert (await client.get("/ready")).status_code == 200
        slow.clear()


async def test_ready_is_503_while_health_says_stalled(tiny_model_fp32: Path) -> None:
    stall, release = threading.Event(), threading.Event()

    def hook(stage: str) -> None:
        if stage == "step" and stall.is_set():
            release.wait(10)

    async with serve(tiny_model_fp32, watchdog_seconds=0.3, factory=engine_factory(fault_hook=hook)) as server, \
            server.client() as client:
        try:
            async with trio.open_nursery() as nursery:
                stall.set()
                nursery.start_soon(partial(client.post, COMPLETIONS, json={"prompt": "x", "max_tokens": 3}))
                await until_answer(lambda: client.get("/health"), lambda r: r.status_code == 503)
                r = await client.get("/ready")
                assert r.status_code == 503 and r.json()["status"] == "stalled", r.text
                stall.clear()
                release.set()
            await until_answer(lambda: client.get("/ready"), lambda r: r.status_code == 200)
        finally:
            release.set()


async def test_a_client_that_stops_reading_is_cut_once_far_enough_behind(tiny_model_fp32: Path) -> None:
    records: list[Any] = []
    # Steps of at least 5 ms: the 900 tokens take 4.5 s or more, so the request is still
    # decoding when the server cuts it (on a fast CPU the tiny model finished them first,
    # and there was nothing left to abort).
    async with serve(tiny_model_fp32, factory=engine_factory(fault_hook=slow_steps(0.005)),
                     stall_timeout=30, max_unread_tokens=64) as server:
        server.app.observers.append(records.append)
        body = {"messages": HELLO, "max_tokens": 900, "ignore_eos": True, "stream": True, "logprobs": True,
                "top_logprobs": 20}
        sock = await open_raw(server.port, CHAT, body, rcvbuf=4096)
        t0 = trio.current_time()
        await until(lambda: any(r.outcome == "stall" for r in records), within=15)
        assert trio.current_time() - t0 < 10  # long before the 30 s stall timeout
        assert server.engine.statistics().aborts_by_cause.get("stall") == 1
        sock.close()
