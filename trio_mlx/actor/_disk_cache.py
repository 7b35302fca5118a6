"""The prompt cache's disk tier: a restarted server finds its prompt cache's newest entries
(long system prompts, conversations) warm instead of prefilling them again.

Opt-in (`prompt_cache_disk_gb`). Entries are written when the actor stops cleanly and
read back after warm-up, both on the actor thread: arrays never leave it, and writing
while serving would stall decode steps for as long as the disk takes. One file per
entry, written with mlx-lm's `save_prompt_cache` (safetensors, the token ids in its
metadata) and read with `load_prompt_cache`, under a folder named by the model's identity
(its resolved path, config.json, and its weight files' names, sizes and times), so that
no model reads another's KV. With `kv_bits` the entries are quantized (`_kv_quant.py`):
written as mlx-lm's `QuantizedKVCache`s, under a folder of their own (the bits and group
size join its name), so plain and quantized KV never meet. A file that does not load, or
does not hold one single-row `KVCache` (`QuantizedKVCache` of the cache's bits and group
size) per layer of exactly its tokens, is skipped and removed: a broken file never stops
a start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, load_prompt_cache, save_prompt_cache

from ._kv_quant import RowQuantizedKVCache, kv_arrays
from ._prompt_cache import PromptCache

log = logging.getLogger("trio_mlx.actor")
SUFFIX = ".safetensors"
ORDER = "order.json"  # the entries' file names, least recently used first
_NAME = re.compile(r"[0-9a-f]{32}\.safetensors")


def folder(base: Path, model_path: Path, adapter_path: Path | None = None,
           kv: tuple[int, int] | None = None) -> Path:
    """The folder under `base` that holds `model_path`'s entries (with the LoRA adapter at
    `adapter_path` applied: its KV is another model's, so its folder is another one; with
    the KV quantized in groups of `kv[0]` at `kv[1]` bits, another one again)."""
    h = hashlib.sha256(str(model_path.resolve()).encode())
    config = model_path / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for f in sorted(model_path.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    if adapter_path is not None:
        h.update(f"\0adapter:{adapter_path.expanduser().resolve()}".encode())
        for f in sorted(adapter_path.expanduser().glob("adapter*")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    if kv is not None:
        h.update(f"\0kv:{kv[0]}:{kv[1]}".encode())
    return base / h.hexdigest()[:24]


def _savable(layer: Any) -> Any:
    """A layer as mlx-lm's `load_prompt_cache` can make it again: a quantized one as its own
    `QuantizedKVCache` (the subclass that merges into a batch is not among its classes)."""
    if type(layer) is not RowQuantizedKVCache:
        return layer
    out = QuantizedKVCache(layer.group_size, layer.bits)
    out.keys, out.values, out.offset = layer.keys, layer.values, layer.offset
    return out


def _loaded(c: Any, n: int, kv: tuple[int, int] | None) -> Any:
    """A loaded layer as the prompt cache holds it, if it is one single-row cache of exactly
    `n` tokens of the expected kind; else ValueError."""
    if kv is None:
        if type(c) is not KVCache or c.keys is None:
            raise ValueError("not a plain KV cache")
        arrays = [c.keys, c.values]
    else:
        if type(c) is not QuantizedKVCache or c.keys is None or (c.group_size, c.bits) != kv:
            raise ValueError(f"not a KV cache quantized in groups of {kv[0]} at {kv[1]} bits")
        c = _as_row(c)
        arrays = [*kv_arrays(c.keys), *kv_arrays(c.values)]
    if c.offset != n or any(a.shape[0] != 1 or a.shape[2] != n for a in arrays):
        raise ValueError("not one row of exactly its tokens")
    return c


def _as_row(c: Any) -> Any:
    """A loaded `QuantizedKVCache` as the prompt cache holds it (`RowQuantizedKVCache`), its
    triples tuples again (`load_prompt_cache` makes them lists)."""
    out: Any = RowQuantizedKVCache(c.group_size, c.bits)
    out.keys, out.values, out.offset = tuple(c.keys), tuple(c.values), c.offset
    return out


def _name(tokens: tuple[int, ...]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:32] + SUFFIX


def save(cache: PromptCache, where: Path, max_bytes: int) -> int:
    """Write the cache's most recently used entries, up to `max_bytes` of KV, into `where`,
    and their order (ORDER, oldest first); files of entries no longer kept are removed.
    Returns how many it holds."""
    where.mkdir(parents=True, exist_ok=True)
    kept: list[Any] = []
    total = 0
    for entry in reversed(cache.entries()):  # the newest first
        if type(entry.key[0]) is not int:  # salted or on an adapter: kept apart in memory only, never written
            continue
        if total + entry.nbytes <= max_bytes:
            kept.append(entry)
            total += entry.nbytes
    names = []
    for entry in reversed(kept):  # oldest first
        name = _name(entry.key)
        names.append(name)
        path = where / name
        if not path.is_file():
            tmp = where / ("tmp-" + name)
            save_prompt_cache(str(tmp), [_savable(c) for c in entry.layers], {"tokens": json.dumps(entry.key)})
            os.replace(tmp, path)
    tmp = where / (ORDER + ".tmp")
    tmp.write_text(json.dumps(names))
    os.replace(tmp, where / ORDER)
    for f in where.glob("*" + SUFFIX):
        if f.name not in names:
            f.unlink(missing_ok=True)
    return len(kept)


def load(cache: PromptCache, where: Path, layers: int, kv: tuple[int, int] | None = None) -> int:
    """Read `where`'s entries into `cache`, the newest that fit its bound, stored oldest
    first (so that the cache's order is the one written); returns how many it took. `kv`:
    (group size, bits) of a quantized cache (`kv_bits`), whose entries are quantized too."""
    if not where.is_dir() or not cache.enabled:
        return 0
    try:
        order = [n for n in json.loads((where / ORDER).read_text()) if isinstance(n, str) and _NAME.fullmatch(n)]
    except (OSError, ValueError, TypeError):  # only names this module writes: never a path elsewhere
        order = []
    listed = set(order)
    files = [where / n for n in order if (where / n).is_file()]
    files = [f for f in sorted(where.glob("*" + SUFFIX)) if f.name not in listed] + files
    fit: list[Path] = []
    total = 0
    for f in reversed(files):  # the newest first
        size = f.stat().st_size
        if total + size > cache.max_bytes:
            break
        fit.append(f)
        total += size
    taken = 0
    for f in reversed(fit):
        try:
            found, meta = load_prompt_cache(str(f), return_metadata=True)
            tokens = tuple(int(t) for t in json.loads(meta["tokens"]))
            if len(found) != layers:
                raise ValueError("not one cache per layer")
            found = [_loaded(c, len(tokens), kv) for c in found]
            mx.eval([a for c in found for a in (*kv_arrays(c.keys), *kv_arrays(c.values))])
        except Exception as exc:  # a broken or foreign file: skipped, and gone
            log.warning("prompt cache: dropping %s (%s)", f.name, exc)
            f.unlink(missing_ok=True)
            continue
        taken += cache.store(tokens, found)
    return taken


def read_in(cache: PromptCache, where: Path, layers: int, kv: tuple[int, int] | None) -> None:
    """`load`, logged: once warm."""
    t0 = time.perf_counter()
    n = load(cache, where, layers, kv)
    log.info("prompt cache: read %d entries (%.1f MB) from %s in %.2f s", n, cache.nbytes / 1e6, where,
             time.perf_counter() - t0)


def write_out(cache: PromptCache, where: Path, max_bytes: int) -> None:
    """`save`, logged: at a clean stop, which a full or read-only disk does not stop."""
    t0 = time.perf_counter()
    try:
        n = save(cache, where, max_bytes)
    except Exception as exc:
        log.warning("prompt cache: could not write %s (%s)", where, exc)
        return
    log.info("prompt cache: wrote %d entries to %s in %.2f s", n, where, time.perf_counter() - t0)
