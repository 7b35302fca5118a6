"""What a served model's process loads at startup is frozen out of Python's cyclic collector
(`trio_mlx/_heap.py`: its walks over it stalled every stream for ~300 ms on a GPU host), and
thawed when the model is dropped, so that its cycles still go."""

from __future__ import annotations

import gc

import pytest

import trio_mlx
from trio_mlx import _heap


@pytest.fixture(autouse=True)
def freezing(monkeypatch):
    monkeypatch.setattr(_heap, "enabled", True)  # the suite turns it off (conftest.py)


def tracked(obj: object) -> bool:
    """Whether `obj` is among the objects the collector walks (the frozen ones are not)."""
    return any(o is obj for o in gc.get_objects())


@pytest.mark.parametrize("actor", ["thread", "process"])
async def test_what_startup_loaded_is_frozen_and_what_serving_makes_is_not(tiny_model_fp32, actor):
    gc.unfreeze()  # whatever an earlier test left frozen
    async with trio_mlx.open_engine(tiny_model_fp32, actor=actor) as engine:
        assert gc.get_freeze_count() > 0
        assert not tracked(engine) and not tracked(engine.tokenizer)  # alive at startup: frozen
        async with engine.generate([5, 6, 7], max_tokens=3, temperature=0) as events:
            made = [e async for e in events]
        assert made and tracked(made)  # made while serving: collected as ever


async def test_dropping_the_model_thaws_the_heap(tiny_model_fp32):
    gc.unfreeze()
    async with trio_mlx.open_engine(tiny_model_fp32, actor="thread") as engine:
        assert gc.get_freeze_count() > 0 and not tracked(engine)
    # the actor thawed it as it dropped the model: a cycle alive at startup can be collected again
    assert gc.get_freeze_count() == 0 and tracked(engine)
