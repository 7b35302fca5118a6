"""Faults injected through the actor's test hook (create_app(engine_factory=...)): a failing step,
a dying actor, a stalled step. Every request ends with a terminal answer; nothing hangs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import trio
from app_server import (
    CHAT,
    COMPLETIONS,
    HELLO,
    assert_error,
    engine_factory,
    scrape,
    serve,
    until,
    until_answer,
)

from integration.test_app_stream import data_events

# Requests of every shape: (key, path, body, sequences it puts in the batch)
MIX: list[tuple[str, str, dict[str, Any], int]] = [
    ("chat-stream", CHAT, {"messages": HELLO, "stream": True}, 1),
    ("text-stream", COMPLETIONS, {"prompt": "once", "stream": True}, 1),
    ("chat-stream-n2", CHAT, {"messages": HELLO, "stream": True, "n": 2}, 2),
    ("chat-whole", CHAT, {"messages": HELLO}, 1),
    ("text-whole", COMPLETIONS, {"prompt": "once"}, 1),
    ("text-whole-n2", COMPLETIONS, {"prompt": "twice", "n": 2}, 2),
]
SEQUENCES = sum(n for *_, n in MIX)


async def run_mix(client: httpx.AsyncClient, results: dict[str, Any], max_tokens: int = 900) -> None:
    """Send every request of MIX at once; results[key] is the event list (streams) or the response."""

    async def one(key: str, path: str, body: dict[str, Any]) -> None:
        body = {**body, "max_tokens": max_tokens, "ignore_eos": True}
        if body.get("stream"):
            async with client.stream("POST", path, json=body) as resp:
                assert resp.status_code == 200
                results[key] = data_events(b"".join([c async for c in resp.aiter_raw()]))
        else:
            results[key] = await client.post(path, json=body)

    async with trio.open_nursery() as nursery:
        for key, path, body, _ in MIX:
            nursery.start_soon(one, key, path, body)


def assert_all_ended_with(results: dict[str, Any], status: int, code: str) -> None:
    assert set(results) == {key for key, *_ in MIX}
    for key, got in results.items():
        if isinstance(got, list):  # a stream: chunks, then one error event, then [DONE]
            assert got[-1] == "[DONE]", (key, got[-3:])
            assert set(got[-2]) == {"error"} and got[-2]["error"]["code"] == code, (key, got[-2])
            assert all("choices" in e for e in got[:-2]), key
            assert "injected" not in repr(got)
        else:
            assert_error(got, status, code=code)
            assert "injected" not in got.text


def armed_hook(stage_to_fail: str, step_delay: float = 0.003) -> tuple[threading.Event, Callable[[str], None]]:
    """A fault hook that slows steps and, once armed, raises once in `stage_to_fail`."""
    armed = threading.Event()

    def hook(stage: str) -> None:
        if stage == "step":
            time.sleep(step_delay)
        if stage == stage_to_fail and armed.is_set():
            armed.clear()
            raise RuntimeError(f"injected {stage} fault")

    return armed, hook


async def test_a_failed_step_ends_every_request_in_the_batch_then_the_server_recovers(tiny_model_fp32):
    armed, hook = armed_hook("step")
    async with serve(tiny_model_fp32, factory=engine_factory(fault_hook=hook)) as server, \
            server.client() as client:
        engine = server.engine
        results: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_mix, client, results)
            await until(lambda: engine.statistics().decoding == SEQUENCES)
            armed.set()
        assert_all_ended_with(results, 500, "generation_failed")
        stats = engine.statistics()
        assert stats.step_failures == SEQUENCES and stats.active == stats.queued == 0
        assert stats.state == "ready"
        # recovered: healthy, and new requests are served whole and correct
        assert (await client.get("/health")).status_code == 200
        r = await client.post(CHAT, json={"messages": HELLO, "max_tokens": 7, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 7
        m = await scrape(client)
        assert m.value("trio_mlx_step_failures_total") == SEQUENCES
        failed = sum(m.value("trio_mlx_request_outcomes_total", endpoint=p, outcome="failed") for p in (CHAT, COMPLETIONS))
        assert failed == len(MIX)


async def die_under_the_mix(engine: Any, client: Any, armed: trio.Event) -> None:
    """Run MIX with 2 sequences decoding and the rest queued or prefilling, then set `armed`
    (a fault hook kills the actor): every waiter, queued or decoding, ends at once with 500."""
    results: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_mix, client, results)
        await until(lambda: (s := engine.statistics()).decoding == 2
                    and s.queued + s.prefilling == SEQUENCES - 2)
        armed.set()
        t0 = trio.current_time()
    assert trio.current_time() - t0 < 2.0
    assert_all_ended_with(results, 500, "generation_failed")

async def test_an_actor_death_ends_every_waiter_at_once_and_health_turns_503(tiny_model_fp32):
    armed, hook = armed_hook("loop")
    # max_batch 2: most of the mix waits in the queue when the actor dies
    async with serve(tiny_model_fp32, max_batch=2, prefill_batch=2, factory=engine_factory(fault_hook=hook)) \
            as server, server.client() as client:
        await die_under_the_mix(server.engine, client, armed)
        r = await client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "broken"
        assert (await client.get("/ready")).status_code == 503
        assert_error(await client.post(CHAT, json={"messages": HELLO}), 503, code="engine_broken")
        m = await scrape(client)
        assert m.value("trio_mlx_engine_state", state="broken") == 1
        assert m.value("trio_mlx_engine_state", state="ready") == 0


async def test_a_stalled_step_turns_health_503_and_back_to_200(tiny_model_fp32):
    stall, release = threading.Event(), threading.Event()

    def hook(stage: str) -> None:
        if stage == "step" and stall.is_set():
            release.wait(10)  # bounded: a failing test never leaves the actor stuck

    async def health() -> httpx.Response:
        return await client.get("/health")

    async with serve(tiny_model_fp32, watchdog_seconds=0.3, factory=engine_factory(fault_hook=hook)) as server, \
            server.client() as client:
        try:
            out: dict[str, Any] = {}
            first = trio.Event()

            async def streamed() -> None:
                body = {"prompt": "x", "max_tokens": 40, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                raw = b""
                async with client.stream("POST", COMPLETIONS, json=body) as resp:
                    async for chunk in resp.aiter_raw():
                        raw += chunk
                        if b"data: " in raw:
                            first.set()
                out["events"] = data_events(raw)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(streamed)
                with trio.fail_after(10):
                    await first.wait()
                stall.set()
                assert (await health()).status_code == 200  # not yet past the deadline
                r = await until_answer(health, lambda r: r.status_code == 503)
                assert r.json()["status"] == "stalled" and r.json()["seconds_since_step"] > 0.3
                m = await scrape(client)
                assert m.value("trio_mlx_seconds_since_step") > 0.3
                stall.clear()
                release.set()
                await until_answer(health, lambda r: r.status_code == 200)
            # the stalled request then completed, whole
            events = out["events"]
            assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 40
            assert events[-3]["choices"][0]["finish_reason"] == "length"
        finally:
            release.set()


async def test_a_stalled_status_reports_more_seconds_than_the_watchdog(tiny_model_fp32):
    """Just past the watchdog (0.3002 s against 0.3), /health and /ready say "stalled" with a
    figure past it too: rounded to the millisecond it would read 0.3, no more than the watchdog."""
    import dataclasses

    async with serve(tiny_model_fp32, watchdog_seconds=0.3) as server, server.client() as client:
        engine = server.engine
        stats = engine.statistics
        engine.statistics = lambda: dataclasses.replace(stats(), seconds_since_step=0.3002)  # type: ignore[method-assign]
        try:
            for path in ("/health", "/ready"):
                r = await client.get(path)
                assert r.status_code == 503 and r.json()["status"] == "stalled", r.text
                assert r.json()["seconds_since_step"] > 0.3, r.text
        finally:
            del engine.statistics


async def test_an_actor_that_dies_before_its_next_graph_still_hands_its_last_tokens_over(tiny_model_fp32,
                                                                                        monkeypatch):
    """The thread link holds a decode step's report until the actor has built its next graph
    (`ThreadLink`, docs/design.md rule 2). An actor that dies in between (here as aborted rows
    leave the batch, before the step) never builds it: the engine takes the held report in
    once the actor's thread has ended, so a stream gets every token the actor reported."""
    import trio_mlx
    from trio_mlx.actor import _link

    reported: dict[int, int] = {}  # rid -> tokens the actor handed its link
    exchange = _link.ThreadLink.exchange

    def counting(self: Any, report: Any) -> Any:
        for t in report.tokens:
            reported[t.rid] = reported.get(t.rid, 0) + 1
        return exchange(self, report)

    monkeypatch.setattr(_link.ThreadLink, "exchange", counting)
    armed, hook = armed_hook("removed")
    received = 0
    ends: list[str] = []
    async with trio_mlx.open_engine(tiny_model_fp32, fault_hook=hook, restart_limit=0, warmup=False,
                                    max_batch=4) as engine:
        with trio.fail_after(60):
            async with engine.generate([5, 6, 7], temperature=0, ignore_eos=True, max_tokens=900) as kept:
                rid = kept._req.rid  # type: ignore[union-attr]
                async with engine.generate([8, 9], temperature=0, ignore_eos=True, max_tokens=900) as left:
                    await left.__anext__()
                    while received < 5:
                        event = await kept.__anext__()
                        received += len(event.token_ids)
                    armed.set()  # `left` closes: its abort kills the actor as its row leaves
                async for event in kept:
                    if isinstance(event, trio_mlx.TextDelta):
                        received += len(event.token_ids)
                    else:
                        ends.append(event.finish_reason)
    assert ends == ["error"]
    assert received == reported[rid] >= 5, (received, reported)
