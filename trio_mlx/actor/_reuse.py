"""When the actor stores into the prompt cache and looks it up (`_prompt_cache.py` is the store).

`Reuse` is called at each point of a sequence's life in the actor (`_actor.py`):
a group about to enter, a row that finished its prefill, a row that finished,
a row leaving the batch, an abort, a failed step.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import mlx.core as mx

from ._batch import copy_rows
from ._kv_quant import kv_map
from ._prompt_cache import BLOCK, Partition, PromptCache, common_prefix

# A prompt at least this long is stored as soon as it is prefilled, so that
# requests arriving while it decodes (users of one system prompt) share it;
# shorter ones are stored when they finish. Arbitrary: below it a prefill is
# cheap and the copy is not worth the churn.
LONG_PROMPT = 256
# A request waits for a prompt being prefilled beside it (n > 1, a shared system
# prompt arriving together) when that would spare it at least SHARE_MIN tokens, or
# half its prompt if shorter, and never fewer than SHARE_FLOOR: then the shared part
# is computed once. Below the floor a prefill costs less than the wait.
SHARE_MIN = 256
SHARE_FLOOR = BLOCK  # a lookup finds whole blocks or nothing


def share_floor(prompt_len: int) -> int:
    """Tokens a wait for a prompt prefilled beside it must spare to be worth it."""
    return max(SHARE_FLOOR, min(SHARE_MIN, prompt_len // 2))


class Reuse:
    """The actor's side of the cache: what happens to it at each point of a sequence's life.

    - A group about to enter (`split`): a request whose prompt shares more with an
      earlier one of the group than the cache holds waits for that one's prefill
      (n > 1 choices, users of one system prompt arriving together), so the shared
      part is computed once; the rest look their prompts up (`lookup`) and enter
      with the KV found.
    - A row that finished its prefill (`prefilled`): its prompt is stored if long, or
      if others wait for it, and they go back to admission.
    - A row that finished (`finished`, then `leaving` when its row leaves the batch):
      its prompt and answer are stored, cut to the tokens it really produced.
    - An aborted or failed row stores nothing after it: an entry only ever holds a
      prompt that was wholly prefilled or a sequence that finished.

    Every lookup and store is under the request's partition (`Submit.partition`: its
    `cache_salt`, and its adapter), and a request waits only for a prefill of its own
    partition: requests of different salts or adapters share nothing.
    """

    def __init__(self, cache: PromptCache):
        self.cache = cache
        self._store_at_prefill: set[int] = set()  # rids whose prompt is stored when prefilled
        self._prefilling: dict[int, Any] = {}  # rid -> Submit, entered and not yet prefilled
        self._waiting: dict[int, list[Any]] = {}  # leader rid -> Submits waiting for its prefill
        self._parked: dict[int, int] = {}  # waiting rid -> its leader's rid
        self._finishing: dict[int, tuple[int, Partition]] = {}  # uid of a finished row -> (tokens to store, partition)
        self._last_stats: tuple[int, ...] = ()

    @property
    def parked(self) -> int:
        return len(self._parked)

    def arrived(self, sub: Any) -> int | None:
        """A request arrived while others prefill (it waits for them in admission): if one
        of them shares enough of its prompt, that prompt is stored when prefilled, so the
        newcomer finds it (users of one system prompt arriving one after another). Returns
        the rid so marked, if any: a distributed group's rank 0 sends it to the other ranks,
        which see no arrivals (`mark`)."""
        if not self._prefilling or not self.cache.enabled:
            return None
        prompt, salt = sub.prompt, sub.partition
        floor = share_floor(len(prompt))
        for rid, other in self._prefilling.items():
            if rid in self._store_at_prefill or other.partition != salt:
                continue
            shared = common_prefix(prompt, other.prompt, len(prompt) - 1)
            if shared >= floor and shared - self.cache.longest(prompt, salt)[1] >= floor:
                self._store_at_prefill.add(rid)
                return rid
        return None

    def mark(self, rids: Iterable[int]) -> None:
        """A follower rank of a distributed group: store these rows' prompts when prefilled,
        as rank 0's `arrived` decided (the arrivals themselves reach rank 0 only)."""
        self._store_at_prefill.update(rids)

    def split(self, subs: list[Any]) -> list[Any]:
        """The group's Submits that enter now; the others wait for an earlier one's prefill."""
        if not self.cache.enabled or len(subs) < 2:
            return subs
        enter: list[Any] = []
        for s in subs:
            prompt = s.prompt
            cap = len(prompt) - 1
            leader, shared = None, 0
            for e in enter:
                if e.partition != s.partition:
                    continue
                n = common_prefix(prompt, e.prompt, cap)
                if n > shared:
                    leader, shared = e, n
            if leader is not None and shared >= share_floor(len(prompt)):
                held = self.cache.longest(prompt, s.partition)[1]
                if shared - held >= share_floor(len(prompt)):
                    self._waiting.setdefault(leader.rid, []).append(s)
                    self._parked[s.rid] = leader.rid
                    self._store_at_prefill.add(leader.rid)
                    continue
            enter.append(s)
        return enter

    def even(self, subs: list[Any], slack: int) -> tuple[list[Any], list[Any]]:
        """The group's Submits that enter now, and those that wait for the next group.

        A group enters with its cached prefixes evened out to one length (`lookup`), so
        that no row of its prefill is left-padded and the prefill takes the fused
        attention (`_batch.CausalPrefill`; a padded one materializes its scores, 4.6-6.3x
        slower on an H100). Rows cached at most `slack` tokens (the prefill step) beyond
        the group's shortest hit are cut back to it and prefill those tokens again beside
        the others' new ones, at most one more chunk; rows cached less than that (a fresh
        prompt among follow-ups) wait for the next group, the longest hits going first."""
        if not self.cache.enabled or len(subs) < 2:
            return subs, []
        held = [self.cache.longest(s.prompt, s.partition)[1] for s in subs]
        floor = max(held) - slack
        return ([s for s, n in zip(subs, held, strict=True) if n >= floor],
                [s for s, n in zip(subs, held, strict=True) if n < floor])

    def lookup(self, subs: list[Any], grain: int = 1) -> tuple[list[Any] | None, list[list[int]] | None, list[int]]:
        """For `BatchGenerator.insert`: the caches and cached token ids of each Submit
        (None when the cache holds nothing for any), and the cached counts: all of one
        length, the group's shortest hit (`even`), so that no row is left-padded, cut to a
        multiple of `grain` (on CUDA, `_shapes.GRID_PREFIX`: the shape grid)."""
        cache = self.cache
        if not cache.enabled:
            return None, None, [0] * len(subs)
        caches: list[Any] = []
        counts: list[int] = []
        cache.relieve()  # before these prefill: under pressure the cache gives way first
        limit = min(cache.longest(s.prompt, s.partition)[1] for s in subs) // grain * grain
        for s in subs:
            kv, n = cache.fetch(s.prompt, limit, s.partition)
            caches.append(kv)
            counts.append(n)
            self._prefilling[s.rid] = s
            if len(s.prompt) >= LONG_PROMPT:
                self._store_at_prefill.add(s.rid)
        if not any(counts):
            return None, None, counts
        return caches, [list(s.prompt[:n]) for s, n in zip(subs, counts, strict=True)], counts

    def drop(self, rid: int) -> bool:
        """An abort of a waiting request: forget it; True if it was waiting."""
        leader = self._parked.pop(rid, None)
        if leader is None:
            return False
        waiting = self._waiting.get(leader, [])
        waiting[:] = [s for s in waiting if s.rid != rid]
        return True

    def left(self, rid: int) -> list[Any]:
        """A row left before its prefill was stored (aborted, failed): what waited for it."""
        self._store_at_prefill.discard(rid)
        self._prefilling.pop(rid, None)
        waiting = self._waiting.pop(rid, [])
        for s in waiting:
            self._parked.pop(s.rid, None)
        return waiting

    def prefilled(self, bg: Any, rows: list[tuple[int, int, int]]) -> list[Any]:
        """Rows `(rid, uid, prompt length)` finished their prefill this step: store the
        prompts marked for it; returns the Submits that waited for them."""
        marked = {uid: n for rid, uid, n in rows if rid in self._store_at_prefill}
        if not marked:
            for rid, _, _ in rows:
                self._prefilling.pop(rid, None)
            return []
        self.cache.relieve()
        salts = {uid: sub.partition for rid, uid, _ in rows if (sub := self._prefilling.get(rid)) is not None}
        for uid, (layers, tokens) in copy_rows(bg, marked).items():
            self.cache.store(tokens, layers, salts.get(uid, ""))
        released: list[Any] = []
        for rid, _, _ in rows:
            released += self.left(rid)
        return released

    def finished(self, uid: int, tokens: int, salt: Partition = "") -> None:
        """A row finished (not aborted) with `tokens` in its cache that are its own; they
        are stored under `salt` when the row leaves the batch (`leaving`)."""
        if self.cache.enabled:
            self._finishing[uid] = (tokens, salt)

    def leaving(self, bg: Any, uids: list[int]) -> None:
        """Rows about to be removed: store the finished ones' prompts and answers."""
        if not self._finishing:
            return
        found = {uid: f for uid in uids if (f := self._finishing.pop(uid, None)) is not None}
        if not found:
            return
        self.cache.relieve()
        for uid, (layers, tokens) in copy_rows(bg, {uid: n for uid, (n, _) in found.items()}).items():
            self.cache.store(tokens, layers, found[uid][1])

    def dropped(self, uid: int, layers: list[Any] | None, tokens: list[int] | None) -> None:
        """A finished row the generator removed itself (its own max_tokens), with the
        cache it extracted (`GenerationBatch.Response.prompt_cache`)."""
        found = self._finishing.pop(uid, None)
        if found is None or not layers or not tokens:
            return
        n, salt = found
        n = min(n, len(tokens), *(kv.offset for kv in layers))
        cut = []
        for kv in layers:
            c = copy.copy(kv)  # a `KVCache`, or a `RowQuantizedKVCache` (`kv_bits`)
            # contiguous copies: a slice would keep the whole extracted buffer alive
            # while its bytes counted only the slice
            c.keys = kv_map(lambda a: mx.contiguous(a[..., :n, :]), kv.keys)
            c.values = kv_map(lambda a: mx.contiguous(a[..., :n, :]), kv.values)
            c.offset = n
            cut.append(c)
        self.cache.relieve()
        self.cache.store(tokens[:n], cut, salt)

    def reset(self, *, failed: bool) -> list[Any]:
        """The batch was thrown away; forget its rows. After a failed step the cache is
        emptied too (its newest entries were to be computed in that step, and a failure is
        often memory). Returns the Submits that waited, to go back to admission."""
        self._finishing.clear()
        self._store_at_prefill.clear()
        self._prefilling.clear()
        waiting = [s for subs in self._waiting.values() for s in subs]
        self._waiting.clear()
        self._parked.clear()
        if failed:
            self.cache.clear()
        return waiting

    def stats(self) -> tuple[int, ...] | None:
        """The cache's counters when they changed since the last call, else None."""
        stats = self.cache.stats()
        if stats == self._last_stats:
            return None
        self._last_stats = stats
        return stats
