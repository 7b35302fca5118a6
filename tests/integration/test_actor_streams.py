"""An actor thread's MLX streams (`actor/_streams.py`): its own for each life, handed back at the end.

A trio worker thread that ends while the interpreter finalizes runs MLX's thread-local
destructors without Python, and the process aborts after a clean stop; MLX's teardown for
this is `mx.clear_streams()` on the thread, after which the thread's old streams are gone.
"""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
import trio

import trio_mlx
from trio_mlx.actor import _streams


def test_a_thread_whose_streams_were_handed_back_serves_a_second_life() -> None:
    """trio's thread cache may give a later actor the thread an earlier one cleared: each
    life's streams are its own, so MLX works on that thread again (mlx-lm's thread-local
    generation stream, which the first life used, would not); and other MLX work on the
    thread afterwards finds default streams, the CPU's among them."""
    results: list[Any] = []

    def life(x: int) -> int:
        _streams.begin()
        try:
            with mx.stream(_streams.generation()):
                a = mx.arange(10) * x
            b = a + 1  # the default stream
            return int(b.sum().item())
        finally:
            _streams.end()

    def thread() -> None:
        try:
            results.append(life(2))
            results.append(life(3))
            with mx.stream(mx.cpu):  # other MLX work on the thread afterwards (a model's conversion)
                results.append(int((mx.arange(4) + 1).sum().item()))
            results.append(int((mx.arange(2) + 5).sum().item()))
        except Exception as exc:
            results.append(exc)

    t = threading.Thread(target=thread)
    t.start()
    t.join()
    assert results == [100, 145, 10, 11]
    assert int((mx.arange(3) + 1).sum().item()) == 6  # the main thread keeps its own streams


async def test_an_engines_actor_hands_its_streams_back_on_its_thread(tiny_model_fp32, monkeypatch) -> None:
    """The thread actor ends its life with `mx.clear_streams()` on its own thread, after its
    arrays are freed; an engine opened after it (whose actor may land on the same cached
    thread) serves the same tokens."""
    cleared: list[int] = []
    clear = mx.clear_streams

    def counted() -> None:
        cleared.append(threading.get_ident())
        clear()

    monkeypatch.setattr(mx, "clear_streams", counted)
    outputs, threads = [], []
    for _ in range(2):
        async with trio_mlx.open_engine(tiny_model_fp32, max_batch=2, warmup=False) as engine:
            async with engine.generate("same words", max_tokens=6, temperature=0, ignore_eos=True) as events:
                ids: list[int] = []
                async for ev in events:
                    if isinstance(ev, trio_mlx.TextDelta):
                        ids += ev.token_ids
            outputs.append(ids)
            assert engine.info is not None
            threads.append(engine.info.thread_id)
        with trio.fail_after(5):
            while len(cleared) < len(threads):  # noqa: ASYNC110 - the actor's thread ends its life
                await trio.sleep(0.01)
    assert cleared == threads and threading.main_thread().ident not in cleared
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6


def test_the_main_thread_keeps_its_streams() -> None:
    """An actor in a child process lives on its main thread: `end` leaves its streams alone
    (MLX's exit handlers clean up there), so MLX still works on it afterwards."""
    assert threading.current_thread() is threading.main_thread()
    before = mx.default_stream(mx.default_device())
    try:
        _streams.begin()
        _streams.end()
        assert int((mx.arange(4) * 2).sum().item()) == 12
    finally:
        mx.set_default_stream(before)
