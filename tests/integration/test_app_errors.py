"""Every error status the HTTP API sends, each in OpenAI's shape {"error": {message, type, param, code}}.

Here those that come from the engine's state (a full queue, a drain, a failed or stalled step),
on a real model; the ones the HTTP layer answers by itself: tests/unit/test_app_errors.py.
"""

from __future__ import annotations

from functools import partial

import trio
from app_server import (
    CHAT,
    COMPLETIONS,
    assert_error,
    chat_body,
    engine_factory,
    serve,
    slow_steps,
    until,
)


async def test_429_sheds_requests_before_they_reach_the_actor(tiny_model_fp32):
    factory = engine_factory(fault_hook=slow_steps(0.01))
    async with serve(tiny_model_fp32, max_batch=1, prefill_batch=1, max_queue=1, factory=factory) as server:
        engine = server.engine
        async with server.client() as client, trio.open_nursery() as nursery:
            for i, stage in enumerate(("decoding", "queued")):  # one decoding, one queued behind it
                nursery.start_soon(partial(client.post, COMPLETIONS,
                                           json={"prompt": f"p{i}", "max_tokens": 300, "ignore_eos": True}))
                await until(lambda stage=stage: getattr(engine.statistics(), stage) == 1)
            before = engine.statistics()
            for _ in range(5):
                r = await client.post(COMPLETIONS, json={"prompt": "shed", "max_tokens": 5})
                err = assert_error(r, 429, code="queue_full", type="rate_limit_error")
                assert int(r.headers["retry-after"]) >= 1, err
            # n > 1 is shed whole: none of its choices stays submitted
            assert_error(await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 5, "n": 2}), 429)
            after = engine.statistics()
            assert after.requests_submitted == before.requests_submitted
            assert after.requests_rejected == before.requests_rejected + 6
            nursery.cancel_scope.cancel()


async def test_503_while_draining_then_in_flight_requests_end(tiny_model_fp32):
    factory = engine_factory(fault_hook=slow_steps(0.01))
    async with serve(tiny_model_fp32, factory=factory, drain_timeout=0.5) as server, server.client() as client:
        result = {}

        async def in_flight() -> None:
            result["r"] = await client.post(COMPLETIONS, json={"prompt": "long", "max_tokens": 900, "ignore_eos": True})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(in_flight)
            await until(lambda: server.engine.statistics().decoding == 1)
            nursery.start_soon(server.app.drain)
            await until(lambda: server.engine.state != "ready")
            r = await client.get("/ready")
            assert r.status_code == 503 and r.json() == {"status": "draining"}
            r = await client.post(CHAT, json=chat_body())
            assert_error(r, 503, code="service_unavailable", type="server_error")
            assert int(r.headers["retry-after"]) >= 1
        # the drain timeout ended the in-flight request with a terminal error
        assert_error(result["r"], 503, code="aborted")
        assert (await client.get("/ready")).status_code == 503


async def test_500_when_the_step_fails_and_health_when_the_actor_dies(tiny_model_fp32):
    mode = {"fail": None}

    def hook(stage: str) -> None:
        if stage == mode["fail"]:
            raise RuntimeError(f"injected {stage} fault")

    async with serve(tiny_model_fp32, factory=engine_factory(fault_hook=hook)) as server, server.client() as client:
        mode["fail"] = "step"
        r = await client.post(CHAT, json=chat_body())
        assert_error(r, 500, code="generation_failed", type="server_error")
        assert "injected" not in r.text
        mode["fail"] = None
        assert (await client.post(CHAT, json=chat_body(max_tokens=2))).status_code == 200  # recovered
        assert (await client.get("/health")).status_code == 200
        mode["fail"] = "loop"  # outside the step's recovery: the actor dies
        r = await client.post(CHAT, json=chat_body())
        assert r.status_code in (500, 503), r.text
        await until(lambda: server.engine.state == "broken")
        r = await client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "broken"
        assert_error(await client.post(CHAT, json=chat_body()), 503, code="engine_broken")
        assert (await client.get("/ready")).status_code == 503


async def test_health_turns_503_when_a_step_stalls_past_the_watchdog(tiny_model_fp32):
    stall = {"on": False}

    def hook(stage: str) -> None:
        import time

        while stage == "step" and stall["on"]:
            time.sleep(0.01)

    factory = engine_factory(fault_hook=hook)
    async with serve(tiny_model_fp32, factory=factory, watchdog_seconds=0.3) as server, server.client() as client:
        stall["on"] = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(client.post, CHAT, json=chat_body(max_tokens=2)))
            await until(lambda: server.engine.statistics().active == 1 or server.engine.statistics().queued == 1)
            await trio.sleep(0.5)
            r = await client.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "stalled", r.text
            stall["on"] = False
        assert (await client.get("/health")).status_code == 200
