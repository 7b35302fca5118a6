"""Grammar checks run in worker processes, bounded in time and memory (`engine/_grammar_pool.py`).

A JSON schema under 1 KB, a string with an `allOf` of 20 patterns like `.*a.*`, took 45 s
and 2.3 GB to check on the 2-core box, in a one-slot thread that nothing could stop, and
every other structured request waited behind it; with 500 patterns llguidance panicked (a
BaseException) and the server died. Here: a 400 for that request within the bound, the
server serving meanwhile and after, another structured request checked beside it, and a
check whose client left killed. A real hypercorn over the fake actor (the tiny model's
tokenizer).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from app_server import CHAT, assert_error, chat_body, fake_factory, serve, until

from trio_mlx.engine import _grammar_pool

pytestmark = pytest.mark.timeout(60)


def bomb(patterns: int = 20) -> dict[str, Any]:
    """A response_format whose check never ends in reasonable time or memory."""
    allof = [{"pattern": f".*{chr(97 + i % 26)}{i // 26 or ''}.*"} for i in range(patterns)]
    schema = {"type": "object", "properties": {"a": {"type": "string", "allOf": allof}}, "required": ["a"]}
    return {"type": "json_schema", "json_schema": {"name": "bomb", "schema": schema}}


def small(key: str) -> dict[str, Any]:
    """A small response_format (each key a grammar of its own: nothing cached)."""
    schema = {"type": "object", "properties": {key: {"type": "integer"}}, "required": [key]}
    return {"type": "json_schema", "json_schema": {"name": "small", "schema": schema}}


def pool_of(server: Any) -> _grammar_pool.GrammarPool:
    return _grammar_pool._pools[str(server.engine.model_path)]


async def test_a_grammar_bomb_is_a_400_within_the_bound_while_others_are_served(
        tiny_model_fp32: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_grammar_pool, "CHECK_SECONDS", 2.0)
    async with serve(tiny_model_fp32, factory=fake_factory()) as server, server.client() as client:
        r = await client.post(CHAT, json=chat_body(max_tokens=32, response_format=small("warm")))
        assert r.status_code == 200, r.text  # a worker started, and a spare beside it
        await until(lambda: pool_of(server).statistics().idle >= 2, within=20)
        before = pool_of(server).statistics()
        health: list[float] = []
        answers: dict[str, tuple[int, float]] = {}

        async def attack() -> None:
            t = time.monotonic()
            r = await client.post(CHAT, json=chat_body(response_format=bomb()))
            answers["bomb"] = (r.status_code, time.monotonic() - t)
            err = assert_error(r, 400, param="response_format", type="invalid_request_error")
            assert "longer than 2 s" in err["message"], err

        async def poll() -> None:
            while "bomb" not in answers:
                t = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                health.append(time.monotonic() - t)
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(attack)
            nursery.start_soon(poll)
            await trio.sleep(0.3)
            t = time.monotonic()  # another structured request, while the bomb's check runs
            r = await client.post(CHAT, json=chat_body(max_tokens=32, response_format=small("beside")))
            answers["beside"] = (r.status_code, time.monotonic() - t)
            assert r.status_code == 200, r.text
        status, took = answers["bomb"]
        assert 2.0 <= took < 4.0, took
        assert answers["beside"][1] < 1.5, answers  # not held behind the bomb's check (45 s before)
        assert "bomb" in answers and max(health) < 1.0, health
        after = pool_of(server).statistics()
        assert after.timeouts == before.timeouts + 1
        # The same bomb again is refused at once; the server serves on.
        t = time.monotonic()
        r = await client.post(CHAT, json=chat_body(response_format=bomb()))
        assert_error(r, 400, param="response_format")
        assert time.monotonic() - t < 0.5
        assert pool_of(server).statistics().refused_again == after.refused_again + 1
        r = await client.post(CHAT, json=chat_body(max_tokens=32, response_format=small("after")))
        assert r.status_code == 200, r.text


async def test_a_check_past_the_memory_bound_is_a_400_for_that_request_only(
        tiny_model_fp32: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker's address space is capped (Linux): the bomb runs out of it long before any
    # time bound, its worker dies, and the request gets a 400.
    if not sys.platform.startswith("linux"):
        pytest.skip("the memory bound is Linux's RLIMIT_AS; elsewhere the time bound holds it")
    monkeypatch.setattr(_grammar_pool, "CHECK_SECONDS", 30.0)
    monkeypatch.setattr(_grammar_pool, "CHECK_MEMORY", 64 << 20)
    async with serve(tiny_model_fp32, factory=fake_factory()) as server, server.client() as client:
        t = time.monotonic()
        r = await client.post(CHAT, json=chat_body(response_format=bomb(21)))
        err = assert_error(r, 400, param="response_format")
        assert "more memory than the server allows" in err["message"], err
        assert time.monotonic() - t < 20
        r = await client.post(CHAT, json=chat_body(max_tokens=32, response_format=small("after_memory")))
        assert r.status_code == 200, r.text
        assert pool_of(server).statistics().deaths >= 1


async def test_a_check_whose_client_left_is_killed(tiny_model_fp32: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_grammar_pool, "CHECK_SECONDS", 30.0)
    async with serve(tiny_model_fp32, factory=fake_factory()) as server, server.client() as client:
        r = await client.post(CHAT, json=chat_body(max_tokens=32, response_format=small("warm_cancel")))
        assert r.status_code == 200, r.text
        before = pool_of(server).statistics()
        with trio.move_on_after(1.0):  # the client gives up after a second
            await client.post(CHAT, json=chat_body(response_format=bomb(22)))
        await until(lambda: pool_of(server).statistics().cancelled == before.cancelled + 1, within=5)
        r = await client.post(CHAT, json=chat_body(max_tokens=32, response_format=small("after_cancel")))
        assert r.status_code == 200, r.text
