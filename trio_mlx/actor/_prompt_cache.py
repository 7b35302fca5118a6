"""The prompt cache: the KV of earlier prompts and answers, reused by requests that start alike.

A chat client or an agent resends its whole conversation every turn, and many
users share one system prompt. The actor keeps the KV of what it has computed
(a finished sequence's prompt and answer; a long prompt as soon as it is
prefilled) keyed by the token ids, and when a request arrives hands the longest
cached prefix of its prompt to `BatchGenerator.insert(..., caches=...)`, so
that only the rest is prefilled. Bounded by bytes with LRU eviction, and the
first thing to go under memory pressure. Lives on the actor thread: arrays
never leave it.

Built on mlx-lm's pieces where they fit: an entry is one `KVCache` per layer,
`_batch.copy_rows` cuts it out of the batch, and `BatchGenerator` merges what
it is given into its batch. This module is the store; when the actor stores
and looks up is `_reuse.py`. mlx_lm.server's `LRUPromptCache` (and its
`PromptTrie`) does not fit the actor:
- its trie looks for an entry longer than the prompt with a depth-first walk
  that copies its path at every node: quadratic in the depth. Measured on this
  project's CPU dev machine: 1.5-2.5 s for one lookup among 16 conversations of
  8k tokens, on the actor thread, every admission. Here entries are indexed by
  the hashes of their 64-token blocks, each chained to the one before (the
  scheme of vLLM's prefix caching): a lookup hashes the prompt's blocks, walks
  them while some entry shares them, then compares tokens within one block;
- every hit deep-copies the entry (`copy.deepcopy`: for an 8k-token 1B entry,
  256 MB per hit) and trims the copy. The generator only ever reads the caches
  it is given (it merges them into fresh batch arrays), so here a hit is a
  `KVCache` that shares the entry's arrays with a shorter `offset`: a prefix of
  any entry costs nothing to hand out;
- an exact hit leaves no token to prefill, which `BatchGenerator.insert`
  refuses (the last prompt token must go through the model for its logits);
- it bounds entries by count first, and has no eviction counter or pressure hook.
It keeps `LRUPromptCache`'s rule that an entry which extends another makes the
shorter one redundant (both are served from the longer).

A salt (a request's `cache_salt`, the server's key isolation) keeps entries apart:
an entry stored under one salt is found only by lookups with the same salt, so
one user's `cached_tokens` cannot reveal another's prompt. A row on a named LoRA
adapter keys its entries by the adapter too (`Submit.partition`): its KV is another
model's, and no request of another adapter (or of none) finds it. The salt
joins the first id of the entry's key, so every block hash, prefix comparison and
redundancy rule above works on salted keys unchanged; no salt is the shared cache.
"""

from __future__ import annotations

import collections
import copy
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

# Without a setting: this share of the GPU's memory, and on the CPU this many bytes
# at most (a sixteenth of RAM if less).
GPU_SHARE = 0.2
CPU_BYTES = 1 << 30
# Under pressure: when MLX's active memory passes this share of the device's (of
# Metal's recommended working set on Apple silicon), entries are evicted (oldest
# first) until it is back under or the cache is empty.
PRESSURE_SHARE = 0.9
# Entries are indexed by the chained hashes of their full blocks of this many tokens.
# A prompt shares at least one whole block with an entry or misses, and nothing
# shorter than a block is stored: so many short entries (cheap to prefill anyway)
# cannot make every lookup and store scan them all.
BLOCK = 64
# At most this many entries sharing a prompt's deepest indexed block are compared with it.
_CANDIDATES = 256
# At most this many `longest` results are remembered between changes to the entries.
_MEMO = 256


def _device_bytes() -> tuple[int, int, bool]:
    """(the device's memory in bytes, what MLX may use of it, whether it is a GPU): on
    Apple silicon the second is Metal's recommended working set; RAM on the CPU."""
    gpu = mx.default_device().type == mx.DeviceType.gpu
    if gpu:
        try:
            info: dict[str, Any] = dict(mx.device_info())
        except Exception:
            info = {}
        for key in ("memory_size", "total_memory"):
            if isinstance(info.get(key), int) and info[key] > 0:
                working = info.get("max_recommended_working_set_size")
                usable = working if isinstance(working, int) and 0 < working < info[key] else info[key]
                return int(info[key]), int(usable), True
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8 << 30
    return ram, ram, gpu


def budget(gb: float | None, share: float = 1.0) -> tuple[int, int | None]:
    """(the cache's byte bound, the active-memory mark past which it gives way) for a
    setting of `gb` gigabytes (None: from the device's memory, `share` of the default: one
    model's part where several share the device, `ActorConfig.prompt_cache_share`)."""
    memory, usable, gpu = _device_bytes()
    if gb is None:
        limit = int((memory * GPU_SHARE if gpu else min(CPU_BYTES, memory // 16)) * share)
    else:
        limit = int(gb * 1e9)
    return max(0, limit), int(usable * PRESSURE_SHARE) if gpu else None


@dataclass(slots=True)
class _Entry:
    eid: int
    key: tuple[Any, ...]  # the token ids, the first paired with the salt if any (`keyed`)
    layers: list[Any]  # one KVCache (RowQuantizedKVCache with kv_bits) per layer, batch 1, exactly len(key) tokens
    nbytes: int
    blocks: list[int]  # the chained hashes of its full blocks


# A partition of the cache: a request's salt ("" for none), or (adapter, salt) for a row on a
# named adapter (`Submit.partition`).
Partition = str | tuple[str, str]


def keyed(tokens: Sequence[int], salt: Partition = "") -> tuple[Any, ...]:
    """The cache's key for `tokens` under `salt`: the ids themselves without one, else with
    the first id paired with the salt, so that no key of another salt shares a prefix."""
    key = tuple(tokens)
    return ((salt, key[0]), *key[1:]) if salt and key else key


def _block_hashes(tokens: tuple[Any, ...], limit: int | None = None) -> list[int]:
    """Chained hashes of the full `BLOCK`-token blocks of `tokens` (at most `limit`)."""
    out: list[int] = []
    h = 0
    n = len(tokens) // BLOCK if limit is None else min(limit, len(tokens) // BLOCK)
    for i in range(n):
        h = hash((h, tokens[i * BLOCK : (i + 1) * BLOCK]))
        out.append(h)
    return out


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int, start: int = 0) -> int:
    """How many leading ids `a` and `b` (both tuples, or both lists) share, known equal up to
    `start`, counting at most `limit`."""
    n = min(len(a), len(b), limit)
    i = start
    while i + BLOCK <= n and a[i : i + BLOCK] == b[i : i + BLOCK]:  # a block at a time, in C
        i += BLOCK
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptCache:
    """Entries of KV by token ids, longest-prefix lookups, LRU eviction by bytes."""

    def __init__(self, max_bytes: int, pressure_bytes: int | None = None):
        self.max_bytes = max_bytes
        self.pressure_bytes = pressure_bytes
        # Entries by id, least recently used first. Ids, not token tuples, key every map:
        # a tuple is hashed anew at each use, 8k ids at a time.
        self._lru: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._ids = itertools.count()
        self._index: dict[int, dict[int, None]] = {}  # block hash -> ids of entries holding the block
        self._ends: dict[int, dict[int, None]] = {}  # hash of an entry's last full block -> ids
        # `longest` results since the entries last changed, by the prompt tuple's identity (the
        # tuple is kept, so its id is not reused): one admission asks about each of its prompts
        # up to four times (`_reuse.Reuse.split`, `even`, `lookup`, then `fetch`), ~0.1 ms
        # each for an 8k-token prompt on the CPU machine, on the actor thread.
        self._memo: dict[int, tuple[tuple[int, ...], Partition, _Entry | None, int]] = {}
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

    def entries(self) -> list[_Entry]:
        """The entries, least recently used first (the disk tier writes them)."""
        return list(self._lru.values())

    def keys(self) -> list[tuple[Any, ...]]:
        """The entries' token ids, least recently used first."""
        return [e.key for e in self._lru.values()]

    def stats(self) -> tuple[int, int, int, int, int, int]:
        """(lookups, hits, hit tokens, evictions, bytes held, entries)."""
        return self.lookups, self.hits, self.hit_tokens, self.evictions, self.nbytes, len(self._lru)

    # -- lookups -------------------------------------------------------------------

    def _match(self, tokens: tuple[Any, ...]) -> tuple[_Entry | None, int]:
        """The entry sharing the longest prefix with `tokens`, and its length: the prompt's
        blocks are walked while some entry holds them, then the entries holding the last
        one (the newest `_CANDIDATES`) are compared token by token within the next block.
        (None, 0) when no entry holds the prompt's first block."""
        if not self._lru:
            return None, 0
        pool: Any = None
        base, h = 0, 0
        for i in range(len(tokens) // BLOCK):
            h = hash((h, tokens[i * BLOCK : (i + 1) * BLOCK]))
            ids = self._index.get(h)
            if not ids:
                break
            pool, base = ids, (i + 1) * BLOCK
        if pool is None:
            return None, 0
        best: tuple[_Entry | None, int] = (None, 0)
        for eid in itertools.islice(reversed(pool), _CANDIDATES):  # the newest
            entry = self._lru[eid]
            n = common_prefix(tokens, entry.key, len(tokens), base)
            if n > best[1]:
                best = (entry, n)
        found = best[0]
        if found is not None and found.key[:base] != tokens[:base]:
            return None, 0  # the blocks' hashes collided (never seen; checked all the same)
        return best

    def longest(self, prompt: Sequence[int], salt: Partition = "") -> tuple[_Entry | None, int]:
        """The entry under `salt` sharing the longest prefix with `prompt` and how many of its
        tokens serve it: never the whole prompt (its last token must be prefilled for logits)."""
        if not self._lru or len(prompt) < 2:
            return None, 0
        if type(prompt) is tuple:  # immutable: its answer holds until the entries change
            memo = self._memo.get(id(prompt))
            if memo is not None and memo[0] is prompt and memo[1] == salt:
                return memo[2], memo[3]
        entry, n = self._match(keyed(prompt, salt))
        n = min(n, len(prompt) - 1)
        if type(prompt) is tuple:
            if len(self._memo) >= _MEMO:
                self._memo.clear()
            self._memo[id(prompt)] = (prompt, salt, entry, n)
        return entry, n

    def fetch(self, prompt: Sequence[int], limit: int | None = None, salt: Partition = "") -> tuple[list[Any] | None, int]:
        """Caches holding the longest cached prefix of `prompt` (at most `limit` tokens), for
        `BatchGenerator.insert(caches=...)`, and its length; (None, 0) on a miss.

        The caches share the entry's arrays (the generator only reads them: it merges
        them into fresh batch arrays), so a hit copies nothing here, and an entry evicted
        before the generator takes them stays alive until it has."""
        if not self.enabled:
            return None, 0
        self.lookups += 1
        entry, n = self.longest(prompt, salt)
        if limit is not None:
            n = min(n, limit)
        if entry is None or n <= 0:
            return None, 0
        self.hits += 1
        self.hit_tokens += n
        self._lru.move_to_end(entry.eid)
        views = []
        for layer in entry.layers:
            kv = copy.copy(layer)  # a `KVCache`, or a `RowQuantizedKVCache` (`kv_bits`): its arrays shared
            kv.offset = n
            views.append(kv)
        return views, n

    # -- entries -------------------------------------------------------------------

    def store(self, tokens: Sequence[int], layers: list[Any], salt: Partition = "") -> bool:
        """Keep `layers` (one single-row `KVCache` per layer holding exactly `tokens`, or with
        `kv_bits` a `RowQuantizedKVCache`) as
        an entry under `salt`; returns whether it was kept. An entry that a longer one
        already holds is not; entries it extends are dropped (a prefix of an entry is
        served from it)."""
        if not self.enabled or len(tokens) < BLOCK:
            return False
        key = keyed(tokens, salt)
        nbytes = sum(kv.nbytes for kv in layers)  # quantized KV (`kv_bits`) counts its packed bytes
        if nbytes > self.max_bytes:
            return False
        holder, n = self._match(key)
        if holder is not None and n == len(key) and len(holder.key) >= len(key):
            self._lru.move_to_end(holder.eid)  # an entry holds it already
            return False
        blocks = _block_hashes(key)
        for eid in self._prefixes_of(key, blocks):
            self._drop(eid)
        entry = _Entry(next(self._ids), key, layers, nbytes, blocks)
        self._memo.clear()
        self._lru[entry.eid] = entry
        for h in blocks:
            self._index.setdefault(h, {})[entry.eid] = None
        self._ends.setdefault(blocks[-1], {})[entry.eid] = None
        self.nbytes += nbytes
        self.shrink(self.max_bytes)
        return True

    def _prefixes_of(self, key: tuple[Any, ...], blocks: list[int]) -> list[int]:
        """Entries that are proper prefixes of `key`: each shares all its full blocks with
        it, so it ends where `key`'s blocks pass."""
        out = []
        for h in blocks:
            for eid in self._ends.get(h, ()):
                other = self._lru[eid].key
                if len(other) < len(key) and key[: len(other)] == other:
                    out.append(eid)
        return out

    def _drop(self, eid: int) -> int:
        self._memo.clear()
        entry = self._lru.pop(eid)
        for table, hashes in ((self._index, entry.blocks), (self._ends, entry.blocks[-1:])):
            for h in hashes:
                ids = table[h]
                del ids[eid]
                if not ids:
                    del table[h]
        self.nbytes -= entry.nbytes
        return entry.nbytes

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
        requests fail. Returns the bytes let go.

        First, if MLX's buffer cache (freed buffers it keeps for reuse) takes memory past
        the mark too, it is handed back: MLX's CUDA allocator does not reclaim it by itself
        when an allocation fails. It is not enough for a prefill step whose attention
        scores alone outgrow the device: `_shapes.prefill_chunk` bounds those."""
        if self.pressure_bytes is None:
            return 0
        active = mx.get_active_memory()
        if active + mx.get_cache_memory() > self.pressure_bytes:
            mx.clear_cache()
        if not self._lru:
            return 0
        over = active - self.pressure_bytes
        return self.shrink(max(0, self.nbytes - over)) if over > 0 else 0

    def clear(self) -> None:
        """Drop every entry (counted as evictions)."""
        self.shrink(-1)

    def _evict(self) -> int:
        self.evictions += 1
        return self._drop(next(iter(self._lru)))
