"""The prompt cache: the KV of earlier prompts and answers, reused by requests that start alike.

A chat client or an agent resends its whole conversation every turn, and many
users share one system prompt. The actor keeps the KV of what it has computed
(a finished sequence's prompt and answer; a long prompt as soon as it is
prefilled) keyed by the token ids, and when a request arrives hands the longest
cached prefix of its prompt to `BatchGenerator.insert(..., caches=...)`, so
that only the rest is prefilled. Bounded by bytes with LRU eviction, and the
first thing to go under memory pressure. Lives on the actor thread: arrays
never leave it.

Built on mlx-lm's pieces: `PromptTrie` (the token trie of `mlx_lm.server`'s
`LRUPromptCache`) finds the longest shared prefix, `KVCache` holds an entry,
and `BatchGenerator` merges what it is given into its batch. `LRUPromptCache`
itself does not fit the actor, for three reasons:
- every hit deep-copies the entry (`copy.deepcopy`: for an 8k-token 1B entry,
  256 MB per hit) and trims the copy; the generator only ever reads the caches
  it is given (it merges them into fresh batch arrays), so here a hit is a
  `KVCache` that shares the entry's arrays with a shorter `offset`: a prefix of
  any entry costs nothing to hand out;
- an exact hit returns no tokens left to prefill, which `BatchGenerator.insert`
  refuses (the last prompt token must go through the model for its logits);
- it bounds entries by count first and has no eviction counter or pressure hook.
It keeps `LRUPromptCache`'s rule that an entry which extends another makes the
shorter one redundant (both are served from the longer).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, PromptTrie

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
SHARE_FLOOR = 32
# Without a setting: this share of the GPU's memory, and on the CPU this many bytes
# at most (a sixteenth of RAM if less).
GPU_SHARE = 0.2
CPU_BYTES = 1 << 30
# Under pressure: when MLX's active memory passes this share of the device's,
# entries are evicted (oldest first) until it is back under or the cache is empty.
PRESSURE_SHARE = 0.9
_KEY = 0  # PromptTrie keys its tries by model; one model here


def _device_bytes() -> tuple[int, bool]:
    """(the device's memory in bytes, whether it is a GPU); RAM on the CPU."""
    gpu = mx.default_device().type == mx.DeviceType.gpu
    if gpu:
        try:
            info: dict[str, Any] = dict(mx.device_info())
        except Exception:
            info = {}
        for key in ("memory_size", "total_memory"):
            if isinstance(info.get(key), int) and info[key] > 0:
                return int(info[key]), True
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), gpu
    except (ValueError, OSError, AttributeError):
        return 8 << 30, gpu


def budget(gb: float | None) -> tuple[int, int | None]:
    """(the cache's byte bound, the active-memory mark past which it gives way) for a
    setting of `gb` gigabytes (None: from the device's memory)."""
    memory, gpu = _device_bytes()
    if gb is None:
        limit = int(memory * GPU_SHARE) if gpu else min(CPU_BYTES, memory // 16)
    else:
        limit = int(gb * 1e9)
    return max(0, limit), int(memory * PRESSURE_SHARE) if gpu else None


@dataclass(slots=True)
class _Entry:
    key: tuple[int, ...]
    layers: list[Any]  # one KVCache per layer, batch 1, exactly len(key) tokens
    nbytes: int


def _common(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading ids `a` and `b` share, counting at most `limit`."""
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def share_floor(prompt_len: int) -> int:
    """Tokens a wait for a prompt prefilled beside it must spare to be worth it."""
    return max(SHARE_FLOOR, min(SHARE_MIN, prompt_len // 2))


class PromptCache:
    """Entries of KV by token ids, longest-prefix lookups, LRU eviction by bytes."""

    def __init__(self, max_bytes: int, pressure_bytes: int | None = None):
        self.max_bytes = max_bytes
        self.pressure_bytes = pressure_bytes
        self._trie = PromptTrie()
        self._lru: collections.OrderedDict[tuple[int, ...], _Entry] = collections.OrderedDict()
        self.nbytes = 0
        self.lookups = 0
        self.hits = 0
        self.hit_tokens = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def stats(self) -> tuple[int, int, int, int, int, int]:
        """(lookups, hits, hit tokens, evictions, bytes held, entries)."""
        return self.lookups, self.hits, self.hit_tokens, self.evictions, self.nbytes, len(self._lru)

    # -- lookups -------------------------------------------------------------------

    def longest(self, prompt: Sequence[int]) -> tuple[_Entry | None, int]:
        """The entry sharing the longest prefix with `prompt` and how many of its tokens
        serve it: never the whole prompt (its last token must be prefilled for logits)."""
        if not self._lru or len(prompt) < 2:
            return None, 0
        tokens = list(prompt)
        res = self._trie.search(_KEY, tokens)
        cap = len(tokens) - 1
        best: tuple[_Entry | None, int] = (None, 0)
        for key, usable in ((res.exact, cap), (res.shorter, len(res.shorter or ())),
                            (res.longer, min(res.common_prefix, cap))):
            if key is not None and usable > best[1]:
                best = (self._trie.get(_KEY, key), min(usable, cap))
        return best

    def fetch(self, prompt: Sequence[int]) -> tuple[list[Any] | None, int]:
        """Caches holding the longest cached prefix of `prompt`, for
        `BatchGenerator.insert(caches=...)`, and its length; (None, 0) on a miss.

        The caches share the entry's arrays (the generator only reads them: it merges
        them into fresh batch arrays), so a hit copies nothing, and an entry evicted
        before the generator takes them stays alive until it has."""
        if not self.enabled:
            return None, 0
        self.lookups += 1
        entry, n = self.longest(prompt)
        if entry is None or n <= 0:
            return None, 0
        self.hits += 1
        self.hit_tokens += n
        self._lru.move_to_end(entry.key)
        views = []
        for layer in entry.layers:
            kv = KVCache()
            kv.keys, kv.values, kv.offset = layer.keys, layer.values, n
            views.append(kv)
        return views, n

    # -- entries -------------------------------------------------------------------

    def store(self, tokens: Sequence[int], layers: list[Any]) -> bool:
        """Keep `layers` (one single-row `KVCache` per layer holding exactly `tokens`) as
        an entry; returns whether it was kept. An entry that a longer one already holds is
        not; entries it extends are dropped (a prefix of an entry is served from it)."""
        if not self.enabled or len(tokens) < 2:
            return False
        key = tuple(tokens)
        nbytes = sum(kv.keys.nbytes + kv.values.nbytes for kv in layers)
        if nbytes > self.max_bytes:
            return False
        ids = list(key)
        res = self._trie.search(_KEY, ids)
        if res.exact is None and res.longer is not None and res.common_prefix >= len(key):
            self._lru.move_to_end(tuple(res.longer))  # a longer entry holds it already
            return False
        if (old := self._lru.pop(key, None)) is not None:
            self.nbytes -= old.nbytes
        entry = _Entry(key, layers, nbytes)
        self._trie.add(_KEY, ids, entry)
        self._lru[key] = entry
        self.nbytes += nbytes
        for length, redundant in self._trie.pop_prefixes(_KEY, ids):
            if self._lru.pop(key[:length], None) is not None:
                self.nbytes -= redundant.nbytes
        self.shrink(self.max_bytes)
        return True

    def shrink(self, max_bytes: int) -> int:
        """Evict the least recently used entries until at most `max_bytes` are held;
        returns the bytes let go."""
        freed = 0
        while self._lru and self.nbytes > max_bytes:
            freed += self._evict()
        return freed

    def relieve(self) -> int:
        """Under memory pressure (MLX's active memory past the pressure mark) evict
        until the excess is let go or the cache is empty: the cache gives way before
        requests fail. Returns the bytes let go."""
        if self.pressure_bytes is None or not self._lru:
            return 0
        over = mx.get_active_memory() - self.pressure_bytes
        return self.shrink(max(0, self.nbytes - over)) if over > 0 else 0

    def clear(self) -> None:
        """Drop every entry (counted as evictions)."""
        self.shrink(-1)

    def _evict(self) -> int:
        key, entry = self._lru.popitem(last=False)
        self._trie.pop(_KEY, list(key))
        self.nbytes -= entry.nbytes
        self.evictions += 1
        return entry.nbytes


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
    """

    def __init__(self, cache: PromptCache):
        self.cache = cache
        self._store_at_prefill: set[int] = set()  # rids whose prompt is stored when prefilled
        self._prefilling: dict[int, tuple[int, ...]] = {}  # rid -> prompt, entered and not yet prefilled
        self._waiting: dict[int, list[Any]] = {}  # leader rid -> Submits waiting for its prefill
        self._parked: dict[int, int] = {}  # waiting rid -> its leader's rid
        self._finishing: dict[int, int] = {}  # uid of a finished row -> tokens to store
        self._last_stats: tuple[int, ...] = ()

    @property
    def parked(self) -> int:
        return len(self._parked)

    def arrived(self, sub: Any) -> None:
        """A request arrived while others prefill (it waits for them in admission): if one
        of them shares enough of its prompt, that prompt is stored when prefilled, so the
        newcomer finds it (users of one system prompt arriving one after another)."""
        if not self._prefilling or not self.cache.enabled:
            return
        prompt = sub.prompt
        floor = share_floor(len(prompt))
        for rid, other in self._prefilling.items():
            if rid in self._store_at_prefill:
                continue
            shared = _common(prompt, other, len(prompt) - 1)
            if shared >= floor and shared - self.cache.longest(prompt)[1] >= floor:
                self._store_at_prefill.add(rid)
                return

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
                n = _common(prompt, e.prompt, cap)
                if n > shared:
                    leader, shared = e, n
            if leader is not None and shared >= share_floor(len(prompt)):
                held = self.cache.longest(prompt)[1]
                if shared - held >= share_floor(len(prompt)):
                    self._waiting.setdefault(leader.rid, []).append(s)
                    self._parked[s.rid] = leader.rid
                    self._store_at_prefill.add(leader.rid)
                    continue
            enter.append(s)
        return enter

    def lookup(self, subs: list[Any]) -> tuple[list[Any] | None, list[list[int]] | None, list[int]]:
        """For `BatchGenerator.insert`: the caches and cached token ids of each Submit
        (None when the cache holds nothing for any), and the cached counts."""
        cache = self.cache
        if not cache.enabled:
            return None, None, [0] * len(subs)
        caches: list[Any] = []
        counts: list[int] = []
        for s in subs:
            kv, n = cache.fetch(s.prompt)
            caches.append(kv)
            counts.append(n)
            self._prefilling[s.rid] = s.prompt
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
        from ._batch import copy_rows

        self.cache.relieve()
        for layers, tokens in copy_rows(bg, marked).values():
            self.cache.store(tokens, layers)
        released: list[Any] = []
        for rid, _, _ in rows:
            released += self.left(rid)
        return released

    def finished(self, uid: int, tokens: int) -> None:
        """A row finished (not aborted) with `tokens` in its cache that are its own; they
        are stored when the row leaves the batch (`leaving`)."""
        if self.cache.enabled:
            self._finishing[uid] = tokens

    def leaving(self, bg: Any, uids: list[int]) -> None:
        """Rows about to be removed: store the finished ones' prompts and answers."""
        if not self._finishing:
            return
        lengths = {uid: n for uid in uids if (n := self._finishing.pop(uid, None)) is not None}
        if not lengths:
            return
        from ._batch import copy_rows

        self.cache.relieve()
        for layers, tokens in copy_rows(bg, lengths).values():
            self.cache.store(tokens, layers)

    def dropped(self, uid: int, layers: list[Any] | None, tokens: list[int] | None) -> None:
        """A finished row the generator removed itself (its own max_tokens), with the
        cache it extracted (`GenerationBatch.Response.prompt_cache`)."""
        n = self._finishing.pop(uid, None)
        if n is None or not layers or not tokens:
            return
        n = min(n, len(tokens), *(kv.offset for kv in layers))
        cut = []
        for kv in layers:
            c = KVCache()
            c.keys, c.values, c.offset = kv.keys[..., :n, :], kv.values[..., :n, :], n
            cut.append(c)
        self.cache.relieve()
        self.cache.store(tokens[:n], cut)

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
