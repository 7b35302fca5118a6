"""The stream pump's pacing (server/_pump.py, engine/_stream.py `next_event`), over the fake actor.

Tokens that arrive further apart than a stream's gap go out one event each with no timer set:
each timer that expires costs the event loop a cancellation under the GIL, which a thread
actor shares (docs/design.md, rule 7). Coalescing under load, and a stream's end never held
back: tests/integration/test_app_stream.py.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from app_server import COMPLETIONS, engine_factory, serve, sse_events

from trio_mlx.actor import FakeActor

pytestmark = pytest.mark.timeout(60)

PACERS = ("trio_mlx.server._pump", "trio_mlx.engine._stream")


async def test_tokens_slower_than_the_gap_go_out_one_event_each_with_no_timer(
        tiny_model_fp32: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timers: list[tuple[str, str]] = []

    def counted(name: str) -> Any:
        real = getattr(trio, name)

        def counting(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller in PACERS:
                timers.append((name, caller))
            return real(*args, **kwargs)

        return counting

    for name in ("move_on_at", "move_on_after"):
        monkeypatch.setattr(trio, name, counted(name))
    # a step every 20 ms; one stream at 500 events/s has a gap of 2 ms
    factory = engine_factory(actor=partial(FakeActor, step_seconds=0.02))
    async with serve(tiny_model_fp32, factory=factory, max_event_rate=500.0) as server, server.client() as client:
        body = {"prompt": "a", "max_tokens": 12, "stream": True, "ignore_eos": True}
        async with client.stream("POST", COMPLETIONS, json=body) as resp:
            assert resp.status_code == 200
            raw = b"".join([chunk async for chunk in resp.aiter_raw()])
    events = [e[len(b"data: "):] for e in sse_events(raw) if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    content = [e for e in map(json.loads, events[:-1]) if e["choices"][0]["finish_reason"] is None]
    assert len(content) >= 11  # one event per token (the last may go with the finish)
    # the first event's ping timer alone: none per token (before, one expired after every event)
    assert timers == [("move_on_after", "trio_mlx.server._pump")], timers
