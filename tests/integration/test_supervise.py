"""A GPU actor that dies is started again (engine/_supervise.py), within a budget.

In-process (the thread actor, its loop made to raise through the fault hook) and as a real
`trio-mlx serve` process whose actor process is SIGKILLed: every request in flight ends at
once with an error (rule 8); while the new actor loads, /ready and new requests get 503 with
Retry-After and /health stays 200 ("restarting"); then the server serves again. Past the
restart budget the engine is broken and `trio-mlx serve` exits 1.

Here in process; the budget alone: tests/unit/test_supervise.py; as a process:
tests/system/test_supervise.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from app_server import CHAT, HELLO, assert_error, engine_factory, scrape, serve, until, until_answer

from integration.test_faults import die_under_the_mix

pytestmark = pytest.mark.timeout(90)


def dying_hook() -> tuple[threading.Event, Any]:
    """Slows steps; once armed, the actor's loop raises (outside a step's recovery): it dies."""
    armed = threading.Event()

    def hook(stage: str) -> None:
        if stage == "step":
            time.sleep(0.003)
        if stage == "loop" and armed.is_set():
            armed.clear()
            raise RuntimeError("injected actor death")

    return armed, hook


async def test_a_dead_thread_actor_is_restarted_and_the_server_serves_again(tiny_model_fp32: Path) -> None:
    armed, hook = dying_hook()
    factory = engine_factory(fault_hook=hook, restart_limit=2, restart_backoff=1.0)
    async with serve(tiny_model_fp32, max_batch=2, prefill_batch=2, factory=factory) as server, \
            server.client() as client:
        engine = server.engine
        await die_under_the_mix(engine, client, armed)
        # restarting: not ready, new requests 503 with Retry-After, alive
        r = await client.get("/ready")
        assert r.status_code == 503 and r.json()["status"] == "restarting" and r.headers["retry-after"]
        r = await client.post(CHAT, json={"messages": HELLO, "max_tokens": 2})
        assert_error(r, 503, code="service_unavailable")
        assert int(r.headers["retry-after"]) > 0
        r = await client.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "restarting"
        # then ready again, and serving whole answers
        await until_answer(lambda: client.get("/ready"), lambda r: r.status_code == 200, within=20)
        r = await client.post(CHAT, json={"messages": HELLO, "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        stats = engine.statistics()
        assert stats.actor_restarts == 1 and stats.state == "ready" and stats.queued == stats.active == 0
        m = await scrape(client)
        assert m.value("trio_mlx_actor_restarts_total") == 1
        assert m.value("trio_mlx_engine_state", state="ready") == 1
        assert server.app.fatal == []  # type: ignore[attr-defined]


async def dying_request(engine: Any, client: Any, armed: threading.Event) -> Any:
    """A chat request the actor dies under: armed once the request decodes, not before (a
    restarted actor's loop may turn while idle, and would die before the request came)."""
    out: dict[str, Any] = {}

    async def post() -> None:
        out["r"] = await client.post(CHAT, json={"messages": HELLO, "max_tokens": 500, "ignore_eos": True})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(post)
        await until(lambda: engine.statistics().decoding >= 1, within=20)
        armed.set()
    return out["r"]


async def test_past_the_budget_the_engine_is_broken_and_the_server_gives_up(tiny_model_fp32: Path) -> None:
    armed, hook = dying_hook()
    factory = engine_factory(fault_hook=hook, restart_limit=1, restart_backoff=0.1)
    async with serve(tiny_model_fp32, factory=factory) as server, server.client() as client:
        engine = server.engine
        assert_error(await dying_request(engine, client, armed), 500, code="generation_failed")
        await until(lambda: engine.state == "ready", within=20)
        assert_error(await dying_request(engine, client, armed), 500, code="generation_failed")
        await until(lambda: engine.state == "broken")
        await until(lambda: bool(server.app.fatal))  # type: ignore[attr-defined]
        assert "restart limit 1" in server.app.fatal[0]  # type: ignore[attr-defined]
        assert_error(await client.post(CHAT, json={"messages": HELLO}), 503, code="engine_broken")
        assert (await client.get("/health")).status_code == 503
