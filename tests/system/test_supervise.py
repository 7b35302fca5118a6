"""A GPU actor that dies is started again (engine/_supervise.py), within a budget.

In-process (the thread actor, its loop made to raise through the fault hook) and as a real
`trio-mlx serve` process whose actor process is SIGKILLed: every request in flight ends at
once with an error (rule 8); while the new actor loads, /ready and new requests get 503 with
Retry-After and /health stays 200 ("restarting"); then the server serves again. Past the
restart budget the engine is broken and `trio-mlx serve` exits 1.

Here as a process; the budget alone: tests/unit/test_supervise.py; in process:
tests/integration/test_supervise.py.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from app_server import CHAT, HELLO, assert_error, until_answer
from processes import ENV, SERVE, alive, start

pytestmark = pytest.mark.timeout(90)


async def test_a_killed_actor_process_is_restarted_then_past_the_budget_the_server_exits_1(
        tiny_model_fp32: Path) -> None:
    async with trio.open_nursery() as nursery:
        p = await start(nursery, [*SERVE, str(tiny_model_fp32), "--port", "0", "--no-warmup", "--actor",
                                  "process", "--no-access-log", "--restart-limit", "1",
                                  "--restart-backoff", "0.5"])
        try:
            with trio.fail_after(60):
                await p.has_url.wait()
            async with httpx.AsyncClient(base_url=p.url or "", timeout=30) as client:
                first = (await client.get("/health")).json()["actor_pid"]
                assert first != p.proc.pid
                out: dict[str, Any] = {}

                async def long() -> None:
                    out["r"] = await client.post(CHAT, json={"messages": HELLO, "max_tokens": 800,
                                                             "ignore_eos": True})

                async with trio.open_nursery() as inner:
                    inner.start_soon(long)
                    await trio.sleep(0.5)
                    os.kill(first, signal.SIGKILL)
                    t0 = trio.current_time()
                assert trio.current_time() - t0 < 2.0
                assert_error(out["r"], 500, code="generation_failed")
                r = await client.get("/ready")
                assert r.status_code == 503 and r.headers["retry-after"], r.text
                t0 = trio.current_time()
                await until_answer(lambda: client.get("/ready"), lambda r: r.status_code == 200, within=30)
                print(f"serving again {trio.current_time() - t0:.2f} s after the kill")
                second = (await client.get("/health")).json()["actor_pid"]
                assert second != first and alive(second)
                r = await client.post(CHAT, json={"messages": HELLO, "max_tokens": 4, "ignore_eos": True})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
                os.kill(second, signal.SIGKILL)  # the budget (1 restart in 300 s) is spent
            with trio.fail_after(30):
                await p.proc.wait()
            assert p.proc.returncode == 1, p.text
            assert "restart limit 1" in p.text and "Traceback" not in p.text
        finally:
            nursery.cancel_scope.cancel()  # kills the server if it still runs (`processes.start`)


async def test_under_hypercorn_past_the_budget_the_server_exits_non_zero(tiny_model_fp32: Path) -> None:
    """`hypercorn trio_mlx.app:app` (a supervisor and one worker): with restarts off, a killed actor
    ends the server non-zero, although hypercorn's supervisor would exit 0 on its own."""
    from processes import HYPERCORN

    env = {**ENV, "TRIO_MLX_MODEL": str(tiny_model_fp32), "TRIO_MLX_WARMUP": "0", "TRIO_MLX_ACTOR": "process",
           "TRIO_MLX_RESTART_LIMIT": "0"}
    async with trio.open_nursery() as nursery:
        p = await start(nursery, [*HYPERCORN, "-k", "trio", "-b", "127.0.0.1:0", "trio_mlx.app:app"], env=env)
        try:
            with trio.fail_after(60):
                await p.has_url.wait()
            async with httpx.AsyncClient(base_url=p.url or "", timeout=30) as client:
                actor = (await client.get("/health")).json()["actor_pid"]
            os.kill(actor, signal.SIGKILL)
            with trio.fail_after(30):
                await p.proc.wait()
            assert p.proc.returncode != 0, p.text
            assert "restart limit 0" in p.text
        finally:
            nursery.cancel_scope.cancel()  # kills the server if it still runs (`processes.start`)
