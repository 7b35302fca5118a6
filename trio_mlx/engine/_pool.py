"""Several models served by one process, each loaded on first use: `ModelPool`.

Every model has an `Engine` of its own (its tokenizer, request registry, prompt cache and
statistics), and every engine's actor lives on the one GPU thread of an `ActorHost`
(`actor/_host.py`), so MLX work stays on one thread (docs/design.md, rule 1). A request names
its model; `ModelPool.use(name)` yields that model's engine, loading it first when it is not
loaded: a request that arrives meanwhile waits for the same load. At most `max_loaded`
models are loaded at once, and, with `max_bytes`, at most that many bytes of weights (as the
model folders' files hold them, `weight_bytes`); to load one more, the pool unloads the least
recently used idle model (no request in flight, none being admitted), and when every loaded model is busy it
refuses with `ModelCapacityError` (the server's 503 with Retry-After) rather than wait.
An unloaded model's actor frees its arrays on the GPU thread (`Actor.stop`).

A load has a time bound (`load_timeout`, the server's startup_timeout): past it, the load's
requests, and those that come while its work ends, fail with `ModelLoadTimeoutError` (503
with Retry-After); the model stops counting against the bounds and its load is cancelled.
Work that cannot be interrupted (a download in a worker thread, the weights' load on the
GPU thread) ends when it returns; only then may the model be loaded again, so loads of a
model that hangs never pile up. A model whose load failed is not loaded again for
`retry_after` seconds: its requests meanwhile get the same error, so a client that retries
at once does not keep the GPU thread (and every other model's steps) in loads that fail.
Only the listed models exist: a request's name is a key of that table, never a path.
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import trio

from .._errors import (
    EngineClosedError,
    InvalidRequestError,
    ModelBusyError,
    ModelCapacityError,
    ModelLoadError,
    ModelLoadTimeoutError,
)
from ._engine import Engine, gpu_limiter

log = logging.getLogger("trio_mlx.engine")

# How often a request waiting for its model's load logs that it still waits; arbitrary.
_PROGRESS_EVERY = 5.0


def find_models(refs: Iterable[str]) -> dict[str, str]:
    """The models `--models` names, by the name requests use: each entry is a folder of model
    folders (each subfolder with a config.json is one, named after the subfolder), a model
    folder itself (named after it), a `NAME=REF` pair, or any other reference (a hub id),
    named as written. A name given twice is an error."""
    found: dict[str, str] = {}

    def add(name: str, ref: str) -> None:
        if name in found:
            raise ValueError(f"two models are named {name!r}: {found[name]} and {ref}")
        found[name] = ref

    for entry in refs:
        name, eq, ref = entry.partition("=")
        if eq:
            add(name.strip(), ref.strip())
            continue
        path = pathlib.Path(entry).expanduser()
        if (path / "config.json").is_file():
            add(path.name, str(path))
        elif path.is_dir():
            subs = sorted(p for p in path.iterdir() if (p / "config.json").is_file())
            if not subs:
                raise ValueError(f"{entry}: no model folder (one with a config.json) in it")
            for sub in subs:
                add(sub.name, str(sub))
        else:
            add(entry, entry)
    return found


def weight_bytes(ref: str) -> int:
    """The bytes of a model folder's weights (its .safetensors and .gguf files), what loading
    it takes at least; 0 for a reference that is not a folder here (a hub id not fetched yet)."""
    path = pathlib.Path(ref).expanduser()
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.gguf") for f in path.glob(pattern))


State = Literal["unloaded", "loading", "loaded", "unloading"]


@dataclass(eq=False)
class _Slot:
    name: str
    ref: str
    state: State = "unloaded"
    engine: Engine | None = None
    changed: trio.Event = field(default_factory=trio.Event)  # set (and replaced) at each change of state
    pins: int = 0  # requests being admitted to it (or waiting for its load)
    last_used: float = float("-inf")
    error: BaseException | None = None  # why its last load failed
    failed_at: float = float("-inf")  # trio time its last load failed
    loads: int = 0
    nbytes: int | None = None  # its weights' bytes (`weight_bytes`), once a byte bound needed them
    expired: bool = False  # its load ran past the time bound: "unloading" until the load's work ends

    def set_state(self, state: State) -> None:
        self.state = state
        self.changed.set()
        self.changed = trio.Event()

    @property
    def idle(self) -> bool:
        return self.state == "loaded" and self.pins == 0 and (self.engine is None or self.engine.in_flight == 0)


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """One model of the pool, as `ModelPool.status()` reports it."""

    name: str
    state: State
    in_flight: int
    last_used: float  # trio time; -inf when never used
    loads: int  # times it was loaded


class ModelPool:
    """Serve `models` (name -> reference) from one GPU thread, each loaded on first use and
    at most `max_loaded` at once. Start `run` in a nursery; `use(name)` for each request."""

    def __init__(self, models: Mapping[str, str | os.PathLike[str]], *, max_loaded: int = 1,
                 max_bytes: int = 0, retry_after: float = 5.0, load_timeout: float | None = None,
                 engine_options: Mapping[str, Any] | None = None,
                 model_options: Mapping[str, Mapping[str, Any]] | None = None,
                 make_actor: Callable[..., Any] | None = None):
        """`max_bytes`: the most weight bytes loaded at once (`weight_bytes`; 0: no bound but
        `max_loaded`); `load_timeout`: the seconds one load may take (None: no bound); `engine_options`: every model's `Engine` keywords (its tuning,
        max_queue, ...); `model_options`: by model name, the keywords of that model's engine that differ
        (its tuning with its own adapters); `make_actor(config, link)`: the actors the host runs (`Actor` when None)."""
        if not models:
            raise ValueError("a model pool needs at least one model")
        if max_loaded < 1:
            raise ValueError(f"max_loaded must be >= 1, got {max_loaded!r}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes!r}")
        if load_timeout is not None and not load_timeout > 0:
            raise ValueError(f"load_timeout must be > 0 or None, got {load_timeout!r}")
        self.load_timeout = load_timeout
        self._slots = {name: _Slot(name, str(ref)) for name, ref in models.items()}
        self.max_loaded = max_loaded
        self.max_bytes = max_bytes
        self.retry_after = retry_after
        self._options = dict(engine_options or {})
        self._options.pop("actor", None)
        self._model_options = {name: dict(options) for name, options in (model_options or {}).items()}
        from ..actor._host import ActorHost  # no MLX: the host imports the actor on first use

        # Each model's prompt cache takes its part of the default bound: the loaded models'
        # caches together hold what one model's would (an explicit prompt_cache_gb is per model).
        self.host = ActorHost(make_actor, prompt_cache_share=1 / max_loaded)
        self._lock = trio.Lock()  # one load (and the unloads that make room for it) at a time
        self.closing = False  # `aclose` was called: every request is refused
        self._nursery: trio.Nursery | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._slots)

    def status(self) -> list[ModelStatus]:
        return [ModelStatus(s.name, s.state, s.engine.in_flight if s.engine is not None else 0, s.last_used,
                            s.loads) for s in self._slots.values()]

    def engine(self, name: str) -> Engine | None:
        """The model's engine while it is loaded, else None."""
        slot = self._slots.get(name)
        return slot.engine if slot is not None and slot.state == "loaded" else None

    def loaded(self) -> list[Engine]:
        return [s.engine for s in self._slots.values() if s.state == "loaded" and s.engine is not None]

    # -- lifecycle -------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Start the GPU thread; serve until cancelled (`aclose` first, for a drain)."""
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: self.host.run(limiter=gpu_limiter(), task_status=task_status))
            self._nursery = nursery
            task_status.started(self)
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None
                nursery.cancel_scope.cancel()

    async def aclose(self, *, drain_timeout: float = 0.0) -> None:
        """Take no more requests and unload every model, letting requests in flight finish for
        up to `drain_timeout` seconds."""
        self.closing = True
        async with trio.open_nursery() as nursery:
            for slot in self._slots.values():
                if slot.engine is not None:
                    nursery.start_soon(partial(slot.engine.aclose, drain_timeout=drain_timeout))

    async def unload(self, name: str) -> bool:
        """Unload the model now, if it is idle (`ModelBusyError` when it is not: requests in
        flight or being admitted, loading, unloading); False when it was not loaded. A later
        request loads it again. No lock: between the idle check and the state's change nothing
        awaits, so a load making room cannot pick it meanwhile."""
        slot = self._slots.get(name)
        if slot is None:
            raise InvalidRequestError(f"the model {name!r} does not exist", param="model", code="model_not_found")
        if slot.state == "unloaded":
            return False
        if not slot.idle:
            doing = ("serving requests" if slot.state == "loaded" else slot.state)
            raise ModelBusyError(f"the model {name!r} is {doing}: only an idle model is unloaded")
        log.info("unloading the model %r (asked for)", name)
        with trio.CancelScope(shield=True):  # a client that leaves does not leave it half unloaded
            await self._unload(slot)
        return True

    # -- requests --------------------------------------------------------------

    @asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[Engine]:
        """The model's engine, loaded if need be (a request meanwhile waits for the same load).
        While the block runs, the model is not unloaded; enter the request's stream inside it
        (the engine then counts it in flight). Raises `ModelCapacityError` when the model
        cannot be loaded because every loaded model is busy, `ModelLoadError` when it fails
        (`ModelLoadTimeoutError` past `load_timeout`), `EngineClosedError` once the pool closes."""
        slot = self._slots.get(name)
        if slot is None:
            raise InvalidRequestError(f"the model {name!r} does not exist", param="model", code="model_not_found")
        if self.closing:
            raise EngineClosedError("the server is shutting down")
        slot.pins += 1
        try:
            engine = await self._ready(slot)
            slot.last_used = trio.current_time()
            yield engine
        finally:
            slot.pins -= 1
            slot.last_used = trio.current_time()

    async def _ready(self, slot: _Slot) -> Engine:
        waited = trio.current_time()
        waited_load = False
        while True:
            if slot.state == "loaded" and slot.engine is not None:
                return slot.engine
            if slot.state == "unloaded":
                if slot.error is not None and waited_load:
                    raise slot.error  # the load this request waited for failed
                if slot.error is not None and trio.current_time() - slot.failed_at < self.retry_after:
                    raise slot.error  # it failed just now: no load again yet (a client that
                    # retries at once would otherwise hold the GPU thread in loads that fail)
                await self._load(slot)
                continue
            if slot.expired and slot.error is not None:
                raise slot.error  # its load ran out of time and its work is still ending
            waited_load = waited_load or slot.state == "loading"
            # loading or unloading: wait for the change, saying so now and then
            changed = slot.changed
            with trio.move_on_after(_PROGRESS_EVERY):
                await changed.wait()
            if not changed.is_set():
                log.info("a request for the model %r waits for its %s (%.0f s)", slot.name,
                         "load" if slot.state == "loading" else "unload", trio.current_time() - waited)

    async def _load(self, slot: _Slot) -> None:
        """Load the model (unloading idle ones first to stay within the bounds), unless another
        request got there first. The load runs in the pool's own task: a request that leaves
        while it waits (its client gone) does not cancel it for the others."""
        async with self._lock:
            if slot.state != "unloaded":
                return
            await self._make_room(slot)
            if self._nursery is None or self.closing:
                raise EngineClosedError("the server is shutting down")
            slot.error = None
            slot.loads += 1
            changed = slot.changed
            slot.set_state("loading")
            log.info("loading the model %r (%s)", slot.name, slot.ref)
            self._nursery.start_soon(self._life, slot)
            while slot.state == "loading":  # one load at a time
                changed = slot.changed
                await changed.wait()
        if slot.state != "loaded":
            raise slot.error or ModelLoadError(f"the model {slot.name!r} was unloaded as it loaded")
        engine = slot.engine
        if self.max_bytes and not slot.nbytes and engine is not None and engine.model_path is not None:
            slot.nbytes = await trio.to_thread.run_sync(weight_bytes, str(engine.model_path))  # a hub id's

    async def _make_room(self, slot: _Slot) -> None:
        """Unload idle models, least recently used first, until `slot` fits both bounds."""
        if self.max_bytes and slot.nbytes is None:
            slot.nbytes = await trio.to_thread.run_sync(weight_bytes, slot.ref)
        while True:
            taken = [s for s in self._slots.values() if s.state in ("loading", "loaded") and s is not slot]
            held = sum(s.nbytes or 0 for s in taken)
            over_count = len(taken) >= self.max_loaded
            over_bytes = bool(self.max_bytes and taken and held + (slot.nbytes or 0) > self.max_bytes)
            if not (over_count or over_bytes):
                if self.max_bytes and (slot.nbytes or 0) > self.max_bytes:
                    log.warning("the model %r (%.2f GB of weights) is larger than the bound (%.2f GB) by "
                                "itself: loaded alone", slot.name, (slot.nbytes or 0) / 1e9, self.max_bytes / 1e9)
                return
            idle = [s for s in taken if s.idle]
            if not idle:
                bound = (f"--max-loaded-models {self.max_loaded}" if over_count else
                         f"{held / 1e9:.2f} GB of weights of {self.max_bytes / 1e9:.2f}")
                raise ModelCapacityError(
                    f"the model {slot.name!r} cannot be loaded now: {len(taken)} models are loaded "
                    f"({bound}) and every one is serving requests", retry_after=self.retry_after)
            victim = min(idle, key=lambda s: s.last_used)
            log.info("unloading the model %r (least recently used, idle) to load %r", victim.name, slot.name)
            await self._unload(victim)

    async def _unload(self, slot: _Slot) -> None:
        engine = slot.engine
        if engine is None:
            return
        changed = slot.changed
        slot.set_state("unloading")
        await engine.aclose()
        while slot.state == "unloading":  # the life task marks it unloaded as its engine ends
            await changed.wait()
            changed = slot.changed

    async def _life(self, slot: _Slot) -> None:
        """One load of the model: its engine's run, from loading to its close; `slot.error`
        says why, when the load failed."""
        engine = Engine(slot.ref, actor=self.host, **{**self._options, **self._model_options.get(slot.name, {})})
        slot.engine = engine
        slot.expired = False
        t0 = trio.current_time()
        deadline = trio.CancelScope()  # the load's time bound, cancelled once it is loaded
        load = trio.CancelScope()  # the engine's run, cancelled when the bound passes

        class Started:
            def started(self, value: Any = None) -> None:
                deadline.cancel()
                if slot.state == "loading":
                    log.info("the model %r is loaded (%.2f s)", slot.name, trio.current_time() - t0)
                    slot.set_state("loaded")

        async def bound(seconds: float) -> None:
            with deadline:
                await trio.sleep(seconds)
                if slot.state != "loading" or slot.engine is not engine:
                    return
                slot.error = ModelLoadTimeoutError(
                    f"the model {slot.name!r} did not load within {seconds:g} s (startup_timeout); "
                    "its load is cancelled", retry_after=self.retry_after)
                log.error("the model %r did not load within %g s: cancelling its load", slot.name, seconds)
                slot.expired = True
                slot.set_state("unloading")  # its waiters fail now; it no longer counts against the bounds
                load.cancel()

        if self.load_timeout is not None and self._nursery is not None:
            self._nursery.start_soon(bound, self.load_timeout)
        try:
            with load:
                await engine.run(task_status=Started())
        except Exception as exc:
            if not slot.expired:
                slot.error = exc
            log.error("the model %r could not be loaded: %s", slot.name, exc)
        finally:
            deadline.cancel()
            if slot.error is not None and slot.state != "loaded":
                slot.failed_at = trio.current_time()
            slot.engine = None
            slot.expired = False
            if slot.state != "unloaded":
                slot.set_state("unloaded")
