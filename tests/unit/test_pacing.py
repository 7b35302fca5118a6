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


def _count_timers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """The timers the pump and the stream set from now on: (trio's function, the module)."""
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
    return timers


async def _content_events(model: Path, step_seconds: float, max_event_rate: float, tokens: int, n: int = 1) -> int:
    """The events that carry content, over the choices (`n`)."""
    factory = engine_factory(actor=partial(FakeActor, step_seconds=step_seconds))
    async with serve(model, factory=factory, max_event_rate=max_event_rate) as server, server.client() as client:
        body = {"prompt": "a", "max_tokens": tokens, "stream": True, "ignore_eos": True, "n": n}
        async with client.stream("POST", COMPLETIONS, json=body) as resp:
            assert resp.status_code == 200
            raw = b"".join([chunk async for chunk in resp.aiter_raw()])
    events = [e[len(b"data: "):] for e in sse_events(raw) if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return len([c for e in map(json.loads, events[:-1]) for c in e["choices"] if c["finish_reason"] is None])


async def test_tokens_slower_than_the_gap_go_out_one_event_each_with_no_timer(
        tiny_model_fp32: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timers = _count_timers(monkeypatch)
    # a step every 20 ms; one stream at 500 events/s has a gap of 2 ms
    assert await _content_events(tiny_model_fp32, 0.02, 500.0, 12) >= 11  # one a token (the last may end it)
    # the first event's ping timer alone: none per token (before, one expired after every event)
    assert timers == [("move_on_after", "trio_mlx.server._pump")], timers


async def test_the_gap_runs_from_an_events_start_not_from_the_end_of_its_send(
        tiny_model_fp32: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A send that takes 25 ms (a slow socket) does not stretch a 10 ms gap (100 events/s) past
    the next token, 30 ms after the last: that token goes out at once, with no timer. Counted
    from the send's end, every token waited 5 ms more under a timer: at one stream, a gap
    just under the step delayed the tokens whose step came in under gap + send."""
    from trio_mlx.server import _pump

    send = _pump._Stream._send

    async def slow_send(self: Any, body: bytes) -> None:
        await trio.sleep(0.025)
        await send(self, body)

    monkeypatch.setattr(_pump._Stream, "_send", slow_send)
    timers = _count_timers(monkeypatch)
    assert await _content_events(tiny_model_fp32, 0.03, 100.0, 12) >= 11
    waits = [t for t in timers if t[1] == "trio_mlx.engine._stream"]
    assert len(waits) <= 2, timers  # a loaded host's late step, at most (every token, before)


async def test_choices_slower_than_the_gap_go_out_with_no_timer_per_send(
        tiny_model_fp32: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """n > 1 paces its sends as one choice does: the gap runs from a send's start, and only a
    token that comes before it is up waits (before, a timer ran out after every send)."""
    timers = _count_timers(monkeypatch)
    assert await _content_events(tiny_model_fp32, 0.02, 500.0, 12, n=2) >= 20  # about a token a choice a send
    assert len(timers) <= 3, timers  # the first event's ping timer, and a late step or two at most
