"""The prompt cache of a distributed group's rank: kept in step with rank 0's.

Every rank of a group (`_distributed.py`) keeps its own prompt cache
(`_prompt_cache.py`), holding its shard of each entry's KV, and calls it at the
same points of the same rows' lives (`_reuse.py`), so hits, waits for a shared
prefill, stores and the byte bound's evictions come out alike on every rank.
What a rank would decide from what only it sees is decided on rank 0 and
replayed from the step's message: memory-pressure relief (`GroupCache`) and the
rows an arrival marks to be stored when prefilled (`GroupReuse`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ._batch import plain_kv
from ._prompt_cache import PromptCache, budget
from ._protocol import ActorConfig
from ._reuse import Reuse


def group_cache_budget(config: ActorConfig, mode: str) -> tuple[int, int | None]:
    """Rank 0's (prompt cache bound, pressure mark) for the group; every rank takes the bound.

    The bound is rank 0's, sent in bytes: without a setting it comes from a device's
    memory, which may differ from host to host. Each rank's entries hold its own shard of
    the KV, and with tensor parallelism those weigh the same on every rank (each holds
    1/N of the KV heads, and `load_shard` checks they divide), so byte-bounded eviction
    evicts alike; every step's state check compares the bytes held all the same.
    Pipeline parallelism gives each rank a different run of layers, so the bytes (and
    what a byte bound evicts) would differ: no prompt cache there.
    """
    limit, pressure = budget(config.tuning.prompt_cache_gb)
    return (limit, pressure) if mode == "tensor" else (0, None)


class GroupCache(PromptCache):
    """The prompt cache of a group's rank: relieved under memory pressure only when rank 0
    decides it, once per step.

    Pressure is read from a rank's own device (MLX's active memory), so each rank would
    evict at a different moment, and then hit different prefixes, prefill different
    lengths and sum mismatched batches. Instead the store's own `relieve` calls (before a
    lookup, before each store: `_reuse.py`) do nothing; rank 0 counts, when it decides a
    step (`pressure_count`), how many of the oldest entries would let the excess go, and
    every rank, rank 0 too, evicts that many (`evict`) when it applies the step, before
    anything else of it: their entries are the same, in the same LRU order, so the same
    ones go. Everything else the cache decides (hits, stores, the byte bound's evictions)
    depends only on the tokens and on the bytes held, equal on every rank."""

    def relieve(self) -> int:
        return 0

    def pressure_count(self) -> int:
        """Rank 0: how many of the least recently used entries must go to let the memory
        past the pressure mark go (as `PromptCache.relieve` would evict); evicts nothing."""
        if self.pressure_bytes is None:
            return 0
        active = mx.get_active_memory()
        if active + mx.get_cache_memory() > self.pressure_bytes:
            mx.clear_cache()  # what `relieve` does first; the buffer cache is no entry
        over = active - self.pressure_bytes
        count = 0
        for entry in self._lru.values():
            if over <= 0:
                break
            over -= entry.nbytes
            count += 1
        return count

    def evict(self, count: int) -> None:
        """Every rank: evict the `count` least recently used entries (all, if it holds fewer:
        the byte bound may have let some go since rank 0 counted, alike on every rank)."""
        for _ in range(min(count, len(self))):
            self._evict()


class GroupReuse(Reuse):
    """Rank 0's `Reuse`: notes the rows an arrival marked to be stored when prefilled
    (`Reuse.arrived`), which the other ranks cannot see, to send them with the step; the
    mark takes effect on every rank, rank 0 too, when the step is applied (`mark`)."""

    def __init__(self, cache: PromptCache):
        super().__init__(cache)
        self.marks: list[int] = []

    def arrived(self, sub: Any) -> int | None:
        rid = super().arrived(sub)
        if rid is not None:
            self._store_at_prefill.discard(rid)  # not yet: with the step, as on every rank
            if rid not in self.marks:
                self.marks.append(rid)
        return rid


def open_group_cache(model: Any, limit: int, pressure: int | None, leader: bool) -> Reuse:
    """A rank's prompt cache (the actor's `_open_cache`, with the group's bound)."""
    if limit and not plain_kv(model):
        limit = 0  # as on one device: a cache that cannot be cut to a prefix is not reused
    cache = GroupCache(limit, pressure)
    return GroupReuse(cache) if leader else Reuse(cache)
