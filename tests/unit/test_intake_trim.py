"""The intake's trimmer (`server/_intake.py`): freed heap memory handed back after large bodies."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from trio_mlx.server import _intake


@pytest.mark.parametrize("late", [0.5, 2.5])
def test_a_large_body_that_comes_while_a_trim_waits_gets_a_trim_after_it(monkeypatch, late):
    """A trim runs `delay` after a large body; a second body that comes during that wait (the
    trim may run while it is still held) or after it gets a trim of its own, later."""
    trims: list[float] = []
    clock = trio.testing.MockClock(autojump_threshold=0)

    async def in_place(fn: Any, *args: Any, **kwargs: Any) -> Any:  # no worker thread: the clock stays exact
        return fn(*args)

    monkeypatch.setattr(_intake, "malloc_trim", lambda: trims.append(clock.current_time()))
    monkeypatch.setattr(trio.to_thread, "run_sync", in_place)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_intake.trimmer, 1.0)
            await trio.sleep(0.1)
            start = trio.current_time()
            _intake.trim_soon()  # a large body at 0
            await trio.sleep(late)
            _intake.trim_soon()  # another one, during the first trim's wait or after it
            await trio.sleep(5)
            nursery.cancel_scope.cancel()
        assert [round(t - start, 1) for t in trims] == ([1.0, 2.0] if late < 1 else [1.0, late + 1.0])

    trio.run(main, clock=clock)
