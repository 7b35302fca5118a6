"""Overload: past the queue cap requests get 429 + Retry-After at once, never reach the GPU actor,
and the server takes work again as soon as the load drops."""

from __future__ import annotations

import httpx
import trio
from app_server import COMPLETIONS, assert_error, engine_factory, scrape, serve, slow_steps, until

BURST = 30
TOKENS = 30
PROMPT = list(range(5, 45))  # 40 prompt tokens: the actor's prefill counts show whose prompt ran


async def test_a_burst_is_shed_at_once_and_the_server_recovers(tiny_model_fp32):
    factory = engine_factory(fault_hook=slow_steps(0.01))  # one request holds a slot >= 0.3 s
    async with serve(tiny_model_fp32, max_batch=2, prefill_batch=2, max_queue=2, factory=factory) as server:
        engine = server.engine
        limits = httpx.Limits(max_connections=BURST + 5)
        async with server.client(limits=limits, timeout=30) as client:
            body = {"prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True}
            # what one admitted request costs the actor, measured alone
            s0 = engine.statistics()
            assert (await client.post(COMPLETIONS, json=body)).status_code == 200
            s1 = engine.statistics()
            prefill_per_request = s1.prompt_tokens - s0.prompt_tokens
            assert prefill_per_request > 0 and s1.generated_tokens - s0.generated_tokens == TOKENS

            results: list[tuple[httpx.Response, float]] = []

            async def one(i: int) -> None:
                t0 = trio.current_time()
                r = await client.post(COMPLETIONS, json={**body, "stream": i % 3 == 0})
                await r.aread()
                results.append((r, trio.current_time() - t0))

            async with trio.open_nursery() as nursery:
                for i in range(BURST):
                    nursery.start_soon(one, i)
            s2 = engine.statistics()
            m = await scrape(client)

            ok = [(r, t) for r, t in results if r.status_code == 200]
            shed = [(r, t) for r, t in results if r.status_code != 200]
            assert len(ok) + len(shed) == BURST
            assert len(shed) >= BURST // 2, [r.status_code for r, _ in results]
            fastest_ok = min(t for _, t in ok)
            for r, t in shed:
                assert_error(r, 429, code="queue_full", type="rate_limit_error")
                assert int(r.headers["retry-after"]) >= 1
                assert t < fastest_ok, (t, fastest_ok)  # answered before any admitted one could finish
            for r, _ in ok:
                if r.headers["content-type"].startswith("application/json"):
                    assert r.json()["usage"]["completion_tokens"] == TOKENS
                else:
                    assert r.text.endswith("data: [DONE]\n\n") and r.text.count('"finish_reason":"length"') == 1
            # the shed requests never reached the actor: engine-side and actor-side counts
            assert s2.requests_submitted - s1.requests_submitted == len(ok)
            assert s2.requests_rejected - s1.requests_rejected == len(shed)
            # (a prompt is prefilled or, the same prompt again, served from the prompt cache)
            prefilled = s2.prompt_tokens - s1.prompt_tokens
            cached = s2.prompt_cache_hit_tokens - s1.prompt_cache_hit_tokens
            assert prefilled + cached == len(ok) * prefill_per_request
            assert s2.prompt_cache_lookups - s1.prompt_cache_lookups == len(ok)
            assert s2.generated_tokens - s1.generated_tokens == len(ok) * TOKENS
            assert s2.queued == s2.active == 0
            # and /metrics says the same
            assert m.value("trio_mlx_requests_total", endpoint=COMPLETIONS, status="429") == len(shed)
            assert m.value("trio_mlx_engine_requests_rejected_total") == len(shed)
            assert m.value("trio_mlx_engine_requests_submitted_total") == len(ok) + 1

            # The load is gone: the next requests are served at once, none shed.
            with trio.fail_after(5):
                for _ in range(3):
                    r = await client.post(COMPLETIONS, json={**body, "max_tokens": 2})
                    assert r.status_code == 200, r.text


async def test_recovers_as_soon_as_one_slot_frees(tiny_model_fp32):
    factory = engine_factory(fault_hook=slow_steps(0.01))
    async with serve(tiny_model_fp32, max_batch=1, prefill_batch=1, max_queue=0, factory=factory) as server, \
            server.client() as client:
        engine = server.engine
        async with trio.open_nursery() as nursery:
            done = trio.Event()

            async def occupant() -> None:
                r = await client.post(COMPLETIONS, json={"prompt": "a", "max_tokens": 25, "ignore_eos": True})
                assert r.status_code == 200
                done.set()

            nursery.start_soon(occupant)
            await until(lambda: engine.statistics().decoding == 1)
            assert_error(await client.post(COMPLETIONS, json={"prompt": "b", "max_tokens": 2}), 429)
            with trio.fail_after(10):
                await done.wait()
        r = await client.post(COMPLETIONS, json={"prompt": "b", "max_tokens": 2})
        assert r.status_code == 200 and engine.statistics().requests_rejected == 1
