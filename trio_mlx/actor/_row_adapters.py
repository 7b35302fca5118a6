"""Which named LoRA adapter each row of a forward runs with: the actor's bookkeeping by uid,
put on the model's shared selector (`models.AdapterRows`) around each forward by
`_batch.adapter_rows`. No MLX and no mlx-lm here."""

from __future__ import annotations

import contextlib
from typing import Any


class RowAdapters:
    """Which named LoRA adapter each row runs with, by uid, put on the model's shared
    selector (`models.AdapterRows`) around each forward (`_batch.adapter_rows`).

    The rows of a forward are its batch's `uids`, in order: mlx_lm's batches keep that
    list aligned with their KV rows as rows enter (`extend`), leave (`filter`) and split
    off, so the slots follow the rows wherever they go. A uid the actor never named (the
    warm-up's rows, a retired row the actor forgot) runs with no adapter. The array of a mix
    is built once per distinct order of slots, not per step."""

    __slots__ = ("selector", "slots", "_last")

    def __init__(self, selector: Any):
        self.selector = selector
        self.slots: dict[int, int] = {}  # uid -> slot (1..); absent: none
        self._last: tuple[tuple[int, ...], Any] = ((), None)

    def select(self, uids: list[int]) -> None:
        slots = tuple(self.slots.get(u, 0) for u in uids)
        last, index = self._last
        self.selector.set(list(slots), index if slots == last else None)
        if self.selector.index is not None:
            self._last = (slots, self.selector.index)

    def forget(self, uids: list[int]) -> None:
        for u in uids:
            self.slots.pop(u, None)


@contextlib.contextmanager
def selected(adapters: RowAdapters, uids: list[int]) -> Any:
    adapters.select(uids)
    try:
        yield
    finally:  # the graph holds what it read: nothing stale reaches a later forward
        adapters.selector.clear()
