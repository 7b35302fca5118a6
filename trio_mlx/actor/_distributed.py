"""One model over several processes: the group, the command channel, the watchdog, rank 0's part.

Launched by `mlx.launch` (`trio-mlx serve MODEL --distributed tensor`), every
rank joins one `mx.distributed` group and loads its shard with mlx-lm's
`sharded_load` (the model's own `shard` method for tensor parallelism, its
`pipeline` method for pipeline parallelism; nothing is sharded here by hand).
Rank 0 runs the server, the engine and the usual actor on its one thread
(docs/design.md, rule 1), holding a `Leader` as its rank (`_rank.py`); every
other rank runs the same actor holding a `Follower` (`_follower.py`) on its
main thread, with no HTTP and no trio. Each joins the
group on that thread, the one that runs all of its collectives
(`init_group`). The model's
own collectives (an all-reduce after the attention and after the MLP of
every layer) need every rank to run the same forward passes on the same
batch, so the followers replay rank 0's steps:

- Once per step, rank 0 decides the next step's commands (the aborts and the
  submits admission lets in, each with its sampling parameters and seed) and
  sends them through the group itself (`Channel`, one `all_sum` of a small
  byte buffer, as mlx_lm.server shares its requests), one step ahead of
  applying them (`Leader` says why). Admission's decision is made once,
  on rank 0, from its clocks; a follower never decides anything. A step with
  no commands still sends its message: a follower cannot otherwise know that
  no commands are coming, and it must run the step's forward pass in step
  with rank 0 (the cost is one small all-reduce per step; docs/distributed.md
  estimates it). The message also carries rank 0's counts and a digest of
  the tokens it sampled last, which the follower checks against its own.
- Every rank, rank 0 included, then applies the message to its own
  `BatchGenerator` through the same `apply_step` (the actor's own `_apply`,
  with an admission that replays rank 0's decision) and runs the same
  `next()`. All ranks see the same logits (each all-reduce gives every rank
  the same sum), the PRNG is seeded alike on every rank once loaded, seeded
  requests own their keys, and retirement depends only on tokens and step
  counts: the ranks' batches stay identical and their sampled tokens agree,
  without sending a token.
- Every rank keeps its own prompt cache (its shard of each entry's KV), and
  makes the same cache decisions from the same rows; the two that would come
  from what only rank 0 sees (memory pressure, read from a rank's own device;
  the store marks of arrivals, which reach rank 0 only) are made on rank 0
  and ride in the step's message (`_group_cache.py`). The step check
  compares the cache's counters too.
- Idle, rank 0 sends a heartbeat at once and then every `BEAT` seconds, so a
  follower's wait for the next message is bounded too. After a heartbeat a
  follower waits for rank 0's next message blocked on a socket of its own
  (`_wake.py`), not polling inside MLX's collective, and rank 0 wakes it
  before it sends that message.

Failure is total. A collective that raises (the ring backend reports a lost
peer at once) or outlasts its bound (a hung peer: MLX collectives have no
timeout and cannot be interrupted) fails the group: on rank 0 the engine
ends every request with an error event and `/health` turns 503, and then
the process exits with status 1, as a follower does at once. `mlx.launch`
stops the remaining ranks when one exits non-zero.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import logging
import os
import pickle
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .._errors import ModelLoadError
from . import _streams as streams
from ._actor import Actor
from ._admission import Admission
from ._group import GroupError, GroupStatus, env_backend
from ._group_cache import GroupCache, GroupReuse, group_cache_budget, open_group_cache
from ._link import ActorLink
from ._memory import prefill_budget
from ._protocol import Abort, ActorConfig, ActorInfo, Command, Shutdown, StepReport, Submit
from ._rank import Rank
from ._reuse import Reuse
from ._wake import WakeServer

log = logging.getLogger("trio_mlx.distributed")

# Seconds between rank 0's heartbeats while it has nothing to do.
BEAT = 1.0
# Bytes every command message carries in its first collective (a 4-byte length
# and the payload); a larger payload (long prompts) takes a second collective.
INLINE = 1024
# Seconds rank 0 waits after failing its requests before it exits, so the
# error events reach the clients.
EXIT_GRACE = 2.0
_LENGTH = struct.Struct(">I")


def init_group(backend: str = "any") -> tuple[Any, str]:
    """Join the group `mlx.launch` started: (group, backend name). Raises GroupError
    when this process is not one of at least two ranks.

    Call it on the thread that will use the group, the one that holds all of the rank's
    MLX state (rank 0's actor thread, `Leader.life`; a follower's main thread): MLX
    makes a backend's group once per process, and a second call returns the first's."""
    name = env_backend() if backend == "any" else backend
    try:
        group = mx.distributed.init(strict=True, backend=name)
    except Exception as exc:
        raise GroupError(
            f"could not join a distributed group (backend {name}): {exc}; start every rank with "
            "mlx.launch, e.g. `mlx.launch --backend ring -n 2 -- trio-mlx serve MODEL --distributed tensor`"
        ) from exc
    if group.size() < 2:
        raise GroupError("--distributed needs at least 2 ranks: start them with mlx.launch "
                         "(e.g. `mlx.launch --hostfile hosts.json -- trio-mlx serve MODEL --distributed tensor`)")
    return group, name


class Watchdog:
    """Ends the process when a guarded stretch (a collective, a step, the start) outlasts its bound.

    MLX collectives cannot be cancelled or timed out: a rank whose peer hangs
    (or, on some backends, dies) waits in one forever, holding the actor thread
    inside MLX. Nothing on that thread can act, so this thread does: it reports
    the failure (on rank 0: the engine fails every request with an error event),
    and after `grace` seconds ends the process with `os._exit(1)`, the only way
    out of a thread stuck in C++. `mlx.launch` then stops the other ranks.
    """

    def __init__(self, on_failure: Callable[[str], None] | None, *, grace: float, status: GroupStatus | None = None):
        self._on_failure = on_failure
        self._grace = grace
        self._status = status
        self._what: str | None = None
        self._deadline: float | None = None
        self._bound = 0.0
        self._failed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="trio-mlx-group-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, what: str, bound: float) -> Iterator[None]:
        """Fail the group if the body takes more than `bound` seconds (nested guards restore the outer)."""
        outer = self._what, self._deadline, self._bound
        self._what, self._bound, self._deadline = what, bound, time.monotonic() + bound
        try:
            yield
        finally:
            self._what, self._deadline, self._bound = outer

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self.fail(f"{self._what} took more than {self._bound:g} s: a rank is gone or hung")
                return

    def fail(self, reason: str) -> None:
        """The group failed: report it once, then end the process after the grace period."""
        if self._failed.is_set():
            return
        self._failed.set()
        log.critical("the distributed group failed: %s; exiting in %.0f s", reason, self._grace)
        if self._status is not None:
            self._status.failed(reason)
        if self._on_failure is not None:
            try:
                self._on_failure(reason)
            except Exception:
                log.exception("could not report the group's failure to the engine")
        # Whichever comes first, the grace period's end or a normal exit (a SIGTERM drain
        # that finished), the process exits with status 1.
        atexit.register(os._exit, 1)
        timer = threading.Timer(self._grace, os._exit, (1,))
        timer.daemon = True
        timer.start()

    @property
    def failed(self) -> bool:
        return self._failed.is_set()

    def stop(self) -> None:
        self._stop.set()


class Channel:
    """Rank 0's messages to the other ranks, through the group's own collectives.

    A message is a pickle (rank 0 and its followers trust each other as
    mlx_lm.server's ranks do) in a fixed buffer of `INLINE` bytes, summed with
    the followers' zeros by one `all_sum`; a longer one sends its rest (the
    tail) in a second. Collectives run on the model's stream, so every rank
    issues all of its collectives, the model's and these, in one order.

    The step messages are pipelined (`Leader`): rank 0 queues a step's
    message (`post`) ahead of the step before it, and a follower queues its
    receive (`expect`) at the same point of its stream and reads it (`take`)
    once that step is built. A follower learns a tail's length only from the
    head, so a tail goes one step later on both sides: rank 0 queues it after
    that step (`post_tail`), a follower when it reads the head.
    """

    def __init__(self, group: Any, watchdog: Watchdog, status: GroupStatus | None = None):
        self._group = group
        self._watch = watchdog
        self._status = status

    def _sum(self, data: mx.array, what: str, bound: float, wait: bool = True) -> mx.array:
        with self._watch.guard(what, bound):
            try:
                # On the stream the BatchGenerator runs the model on (`_streams.generation`):
                # on any other stream this collective could reach the group before or after
                # the model's own, differently on each rank, and sum the wrong buffers. (The
                # ring backend cannot split the group into a communicator of its own.)
                with mx.stream(streams.generation()):
                    out = mx.distributed.all_sum(data, group=self._group)
                if not wait:
                    # Queued behind the work on the stream; a failure surfaces where it is
                    # read (a follower's `take`), or in rank 0's next step, under its guard.
                    mx.async_eval(out)
                    return out
                mx.eval(out)
            except RuntimeError as exc:  # the ring backend: "connection to a peer was lost"
                raise GroupError(f"{what}: {exc}") from exc
        if self._status is not None:
            self._status.contact()
        return out

    def _pack(self, message: Any) -> tuple[mx.array, bytes]:
        """(the head buffer, the tail: what did not fit in it)."""
        payload = b"" if message is None else pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        buf = bytearray(INLINE)
        _LENGTH.pack_into(buf, 0, len(payload))
        head = INLINE - _LENGTH.size
        buf[_LENGTH.size:_LENGTH.size + min(head, len(payload))] = payload[:head]
        if self._status is not None:
            self._status.messages += 1
            self._status.message_bytes += len(payload)
        return mx.array(np.frombuffer(bytes(buf), dtype=np.uint8)), payload[head:]

    def send(self, message: Any, bound: float, what: str = "sending commands to the followers") -> None:
        """Send `message` (None: an empty one) to every other rank and wait until it went."""
        head, tail = self._pack(message)
        self._sum(head, what, bound)
        if tail:
            self._sum(mx.array(np.frombuffer(tail, dtype=np.uint8)), what, bound)

    def post(self, message: Any, bound: float, what: str = "sending a step to the followers") -> bytes:
        """Queue `message`'s head on the stream without waiting; returns its tail (b"": none),
        which the caller queues with `post_tail` after the step it queued this before."""
        head, tail = self._pack(message)
        self._sum(head, what, bound, wait=False)
        return tail

    def post_tail(self, tail: bytes, bound: float) -> None:
        self._sum(mx.array(np.frombuffer(tail, dtype=np.uint8)), "sending a step to the followers", bound,
                  wait=False)

    def expect(self, bound: float) -> mx.array:
        """A follower: queue the receive of rank 0's next message's head (read it with `take`)."""
        return self._sum(mx.zeros(INLINE, dtype=mx.uint8), "waiting for rank 0", bound, wait=False)

    def take(self, posted: mx.array, bound: float, what: str = "waiting for rank 0") -> Any:
        """The message whose head `expect` queued (None for an empty one); its tail, if any,
        is received now."""
        with self._watch.guard(what, bound):
            try:
                out = bytes(np.array(posted))
            except RuntimeError as exc:
                raise GroupError(f"{what}: {exc}") from exc
        if self._status is not None:
            self._status.contact()
        (n,) = _LENGTH.unpack_from(out)
        if n == 0:
            return None
        head = INLINE - _LENGTH.size
        payload = out[_LENGTH.size:_LENGTH.size + min(n, head)]
        if n > head:
            payload += bytes(np.array(self._sum(mx.zeros(n - head, dtype=mx.uint8), what, bound)))
        return pickle.loads(payload)

    def recv(self, bound: float, what: str = "waiting for rank 0") -> Any:
        """The next message (None for an empty one), waited for now."""
        return self.take(self.expect(bound), bound, what)

    def agree(self, ok: bool, bound: float) -> int:
        """How many ranks are not ok (every rank calls this at the same point)."""
        return self.count(not ok, bound)

    def count(self, yes: bool, bound: float, what: str = "checking the ranks agree") -> int:
        """How many ranks say yes (every rank calls this at the same point)."""
        out = self._sum(mx.array([1 if yes else 0], dtype=mx.int32), what, bound)
        return int(out.item())  # type: ignore[arg-type]


def fingerprint(path: Path) -> str:
    """What every rank compares before loading: the model's config.json, hashed."""
    return hashlib.sha256((Path(path) / "config.json").read_bytes()).hexdigest()[:16]


def hello(config: ActorConfig, mode: str, cache_bytes: int,
          wake: tuple[str, int, bytes] | None = None) -> tuple[Any, ...]:
    """Rank 0's first message: the mode, the model's fingerprint, its whole `ActorTuning`
    (batching must match on every rank), the prompt cache's bound in bytes
    (`group_cache_budget`: the followers take it, not the tuning's prompt_cache_gb) and
    where its wake socket listens (`_wake.py`; None: nowhere)."""
    # Rank 0's device decides the default budget: the other ranks' may differ.
    tuning = dataclasses.replace(config.tuning, prefill_budget=prefill_budget(config.tuning.prefill_budget))
    return ("hello", mode, fingerprint(config.model_path), tuning, cache_bytes, wake)


@contextlib.contextmanager
def _collectives_on_group_stream() -> Iterator[None]:
    """Inside: `mx.distributed.all_sum` ignores a `stream` argument, so the collective runs on
    the stream its group picks (MLX's `communication_stream`: the GPU's for NCCL, the CPU's
    for ring and MPI).

    mlx-lm's `sharded_load` ends with a barrier pinned to the CPU stream (`all_sum(...,
    stream=mx.cpu)`), and MLX's NCCL backend has no CPU path: there, that collective fails
    with "There is no Stream(gpu, 1) in current thread", on whichever thread makes it. The
    rest of `sharded_load` is what it should be, so it is kept and only its barrier moved.
    Rank 0 loads on its actor's thread and a follower on its main thread, before either
    sends anything through the group: nothing else calls a collective while this holds."""
    real = mx.distributed.all_sum

    def all_sum(x: Any, *, stream: Any = None, **kwargs: Any) -> Any:
        return real(x, **kwargs)

    mx.distributed.all_sum = all_sum
    try:
        yield
    finally:
        mx.distributed.all_sum = real


def load_shard(path: Path, mode: str, group: Any) -> tuple[Any, dict[str, Any]]:
    """This rank's shard of the model at `path` through mlx-lm's `sharded_load`."""
    import json

    from mlx_lm.utils import sharded_load

    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    n = group.size()
    if mode == "tensor":
        text = config.get("text_config") or config
        for key in ("num_attention_heads", "num_key_value_heads"):
            heads = text.get(key)
            if isinstance(heads, int) and heads % n:
                raise ModelLoadError(f"tensor parallelism over {n} ranks needs {key} ({heads}) divisible by {n}")
    try:
        with _collectives_on_group_stream():
            model, _tokenizer, config = sharded_load(
                str(path), pipeline_group=group if mode == "pipeline" else None,
                tensor_group=group if mode == "tensor" else None, return_config=True)
    except ValueError as exc:  # "The model does not support pipelining / tensor parallelism"
        hint = ("; `trio-mlx serve --help` (--distributed) and docs/distributed.md name the families mlx-lm "
                "pipelines, and --distributed tensor shards most others" if mode == "pipeline" else "")
        raise ModelLoadError(
            f"mlx-lm cannot shard this model ({config.get('model_type', '?')}) for {mode} parallelism: {exc}{hint}"
        ) from exc
    except FileNotFoundError as exc:
        raise ModelLoadError(f"could not load a {mode}-parallel shard from {str(path)!r}: {exc}"
                             + (" (pipeline parallelism needs model.safetensors.index.json)"
                                if mode == "pipeline" else "")) from exc
    return model, config


def seed_all(channel: Channel, leader: bool, bound: float) -> None:
    """Seed MLX's global PRNG alike on every rank (unseeded sampling then agrees)."""
    if leader:
        seed = int.from_bytes(os.urandom(4), "big")
        channel.send(("seed", seed), bound, "seeding the followers")
    else:
        message = channel.recv(bound, "waiting for rank 0's seed")
        if not (isinstance(message, tuple) and message[:1] == ("seed",)):
            raise GroupError(f"expected rank 0's seed, got {message!r}")
        seed = message[1]
    mx.random.seed(seed)


def token_digest(report: StepReport) -> int:
    """The tokens one step sampled, as one int every rank computes alike (ints hash the
    same in every process): ranks whose sampling diverged would otherwise feed the
    model different tokens and sum garbage without a sign."""
    return hash(tuple(t.token for t in report.tokens))


Step = tuple[tuple[int, ...], tuple[Submit, ...], int, tuple[int, ...]]  # (aborts, admitted, evicted, marks)


def state_of(actor: Actor, digest: int) -> tuple[Any, ...]:
    """What every rank must hold at the same point of its steps (it is compared with rank
    0's before each step, and the group fails if it differs rather than sum the wrong
    batches): the counts of steps, sequences and retired rows, the tokens the last step
    sampled, and the prompt cache's counters (lookups, hits, hit tokens, evictions, bytes,
    entries)."""
    schedule = actor.schedule
    return (schedule.steps, len(schedule.seqs), len(schedule.retired), digest, actor._reuse.cache.stats())


class Replay:
    """The admission a step applies on every rank: exactly the group rank 0 let in.

    On a follower it is the only admission; rank 0 holds the queue, its own
    `Admission` (`real`), which decides, and the step that applies the decision
    (one step later, `Leader`) replays it like a follower's: what the actor's
    `_apply` and `_step` give back to admission (requests that waited for a prompt
    prefilled beside them, finished rows) goes to `real` there, and nowhere on a
    follower (rank 0 sends them again when they enter)."""

    def __init__(self, real: Admission | None = None):
        self.real = real
        self._next: list[Submit] = []

    @property
    def pending(self) -> dict[int, Any]:
        return self.real.pending if self.real is not None else {}

    def replay(self, subs: Sequence[Submit]) -> None:
        self._next = list(subs)

    def add(self, sub: Submit, now: float) -> None:  # pragma: no cover - a step never carries a bare submit
        raise GroupError("a step applied a submit outside an admitted group")

    def drop(self, rid: int) -> bool:
        # Rank 0: a request readmitted since the abort was decided (it waited for a prefill
        # that ended in between) leaves the queue; it is nowhere else on any rank.
        return self.real.drop(rid) if self.real is not None else False

    def readmit(self, subs: list[Submit], now: float) -> None:
        if self.real is not None:
            self.real.readmit(subs, now)

    def due(self, now: float, decoding: int, prefilling: bool) -> list[Submit]:
        subs, self._next = self._next, []
        return subs

    def finished(self, now: float, count: int) -> None:
        if self.real is not None:
            self.real.finished(now, count)

    def hold(self, now: float) -> float:
        return self.real.hold(now) if self.real is not None else 0.0


def apply_step(actor: Actor, replay: Replay, step: Step | None) -> list[tuple[int, str]]:
    """Apply one step's message to `actor`'s batch, alike on every rank: rank 0's pressure
    relief first (it evicted nothing itself), the rows its arrivals marked to be stored
    when prefilled, the aborts, the admitted group. Returns the inserts that failed."""
    aborts, subs, evicted, marks = step or ((), (), 0, ())
    cache = actor._reuse.cache
    if evicted:
        assert isinstance(cache, GroupCache)
        cache.evict(evicted)
    replay.replay(subs)
    actor._reuse.mark(marks)
    return actor._apply([Abort(rid) for rid in aborts]) or []


class _BeatingLink:
    """Rank 0's link to its engine: the thread link, plus a heartbeat to the followers
    while the actor waits for commands with nothing to do: at once where the wait may
    outlast `BEAT` (the followers then wait blocked, `_wake.py`, rather than in a
    collective), and every `BEAT` seconds after. A short wait (admission holding
    arrivals for company, milliseconds) sends none."""

    def __init__(self, link: ActorLink, beat: Callable[[], None]):
        self._link, self._beat = link, beat

    def ready(self, info: ActorInfo) -> None:
        self._link.ready(info)

    def exchange(self, report: StepReport) -> list[Command]:
        return self._link.exchange(report)

    def check(self) -> None:
        self._link.check()

    def built(self) -> None:
        self._link.built()

    def wait_commands(self, timeout: float | None = None) -> list[Command]:
        deadline = None if timeout is None else time.monotonic() + timeout
        if timeout is None or timeout > BEAT:
            commands = self._link.wait_commands(0.0)
            if commands:
                return commands
            self._beat()
        while True:
            left = BEAT if deadline is None else min(BEAT, deadline - time.monotonic())
            commands = self._link.wait_commands(max(0.0, left))
            if commands or (deadline is not None and time.monotonic() >= deadline):
                return commands
            self._beat()


class GroupRank(Rank):
    """What every rank of a group changes alike (`Leader`, `_follower.Follower`): steps cut
    alike on every rank, no disk tier, each stage bounded by the group's watchdog, and a
    failure of the group or of a step fails the group at once, before the actor's cleanup
    (which may wait on the broken collective) runs."""

    progress_cut = False  # every rank cuts its steps alike: by no rate measured on one
    disk = False  # every rank holds its own shard of the prompt cache, in lockstep: no disk tier
    settles_after_handover = False  # a dry batch's rows leave in the step, on every rank alike

    _watch: Watchdog
    _timeout: float  # the bound on each wait once serving ...
    _startup: float  # ... and on each while starting
    number = 0  # the rank's number in the group

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        try:
            yield
        except GroupError as exc:
            self._watch.fail(str(exc))
            raise

    @contextlib.contextmanager
    def stage(self, what: str, startup: bool = False) -> Iterator[None]:
        with self._failing(), self._watch.guard(what, self._startup if startup else self._timeout):
            yield

    def recover(self, exc: BaseException, failed: list[tuple[int, str]]) -> StepReport:
        # A single device starts a fresh generator and serves on; a group cannot
        # know that every rank failed the same step, so its batches may differ.
        raise GroupError(f"a generation step failed on rank {self.number}: {type(exc).__name__}: {exc}") from exc


class Leader(GroupRank):
    """Rank 0's part in its actor (`_rank.py`): the usual actor, loading its shard and
    deciding each step's commands one step ahead of applying them, so that they reach the
    followers before they build that step.

    A follower must hold a step's commands before it builds the step's forward pass,
    and the message travels on the model's stream (`Channel`), behind whatever the
    stream is computing. Sent just before the step, it would reach a follower only when
    the previous step finished, and the follower would build each step while its device
    idled: a single device overlaps that host work with the previous step (the
    BatchGenerator computes one step ahead). So rank 0 decides a step's commands (its
    admission, the aborts, pressure relief, the rows its arrivals mark) and queues their
    message ahead of the step before it; then every rank, rank 0 included, applies
    them one step later through the same `apply_step`. A follower queues its receive at
    the same point of its stream and reads the message once it has built the step in
    between, by when it has arrived. The price is one step of latency (a decode step,
    milliseconds) on admissions and aborts.
    """

    def __init__(self, config: ActorConfig, *, backend: str, mode: str, status: GroupStatus, timeout: float,
                 startup_timeout: float, on_failure: Callable[[str], None] | None):
        if config.tuning.speculation is not None:  # its steps' shapes follow tokens each rank reads back
            raise ValueError("speculative decoding needs a single rank, not a distributed group")
        if config.tuning.kv_bits is not None:  # not built or tested across ranks
            raise ValueError("kv_bits needs a single rank, not a distributed group")
        self._backend, self._mode, self._status = backend, mode, status
        self._timeout, self._startup = timeout, startup_timeout
        self._watch = Watchdog(on_failure, grace=EXIT_GRACE, status=status)
        self._group: Any = None  # joined in `life`, on the actor's thread (`_join`)
        self._channel: Channel  # made there too
        self._real: Admission  # the queue and the decisions (`bind`); the loop steps through `_replay`
        self._replay: Replay
        self._stopped = False
        self._digest = 0
        self._cache_bytes, self._pressure = group_cache_budget(config, mode)
        self._ahead: Step | None = None  # sent, not yet applied (None: nothing to apply)
        self._wake: WakeServer | None = None  # opened in `life`
        self._asleep = False  # the last message was a heartbeat: wake the followers before the next

    def bind(self, actor: Any, link: ActorLink) -> ActorLink:
        super().bind(actor, link)
        self._real = actor._admission
        self._replay = Replay(self._real)
        return _BeatingLink(link, self._beat)

    @contextlib.contextmanager
    def life(self) -> Iterator[None]:
        try:
            with self._watch.guard("starting the group", self._startup):
                self._join()
                self._status.set_all("loading", leader="loading")
                self._wake = WakeServer.open()
                wake = self._wake.address if self._wake is not None else None
                self._channel.send(hello(self.actor.config, self._mode, self._cache_bytes, wake), self._startup,
                                   "greeting the followers")
            yield
        except GroupError as exc:
            self._watch.fail(str(exc))
            raise
        finally:
            if not self._watch.failed:
                self._watch.stop()
            if self._wake is not None:
                self._wake.close()

    def _join(self) -> None:
        """Join the group here, on the thread that runs every collective of this rank
        (`init_group` says why), as rank 0 of the size the launcher announced."""
        group, name = init_group(self._backend)
        if group.rank() != 0 or group.size() != self._status.size:
            raise GroupError(f"joined as rank {group.rank()} of {group.size()}, but the launcher announced "
                             f"rank 0 of {self._status.size}")
        self._group = group
        self._channel = Channel(group, self._watch, self._status)
        log.info("rank 0 of %d joined the group over %s on the actor's thread (%s)", group.size(), name,
                 threading.current_thread().name)

    def load_weights(self) -> tuple[Any, dict[str, Any]]:
        config = self.actor.config
        with self._failing(), self._watch.guard("loading the shards", self._startup):
            bad = self._channel.agree(True, self._startup)
            if bad:
                raise ModelLoadError(f"{bad} follower rank(s) could not find the same model "
                                     f"(config.json {fingerprint(config.model_path)}); see their logs")
            woken = self._channel.count(False, self._startup, "counting the followers rank 0 can wake")
            if self._wake is not None:
                self._wake.accept(woken, self._startup)
            if config.tuning.adapter_path or config.tuning.adapters:  # load_shard has no adapter: refuse
                raise ModelLoadError("adapter_path and adapters need a single rank, not a distributed group")
            model, model_config = load_shard(config.model_path, self._mode, self._group)
            seed_all(self._channel, True, self._startup)
        self._status.set_all("following", leader="serving")
        return model, model_config

    def open_cache(self) -> Reuse:
        return open_group_cache(self.actor._model, self._cache_bytes, self._pressure, leader=True)

    def loop(self) -> None:
        actor = self.actor
        actor._admission = self._replay  # type: ignore[assignment]
        try:
            with self._failing():
                self._digest = 0  # as a follower starts (the warm-up's rehearsal stepped here, not counted)
                actor._loop()
        except GroupError:
            raise
        except BaseException:
            if not self._stopped and not self._watch.failed:
                # The actor is leaving for another reason (cancelled): stop the followers too.
                with contextlib.suppress(Exception), self._failing():
                    self._stop_group()
            raise
        finally:
            actor._admission = self._real

    def busy(self) -> bool:
        return bool(self.actor.schedule.seqs) or self._ahead is not None

    def arrivals(self) -> Admission:
        return self._real

    def turn(self, commands: Sequence[Command]) -> StepReport | None:
        """The actor's turn (`Rank.turn`), with each step's commands decided one step ahead
        (the class docstring)."""
        actor = self.actor
        state = state_of(actor, self._digest)  # before the step applies what it holds
        step = self._decide(commands)
        if step is None:  # Shutdown
            self._stop_group()
            return None
        if not (any(step[:2]) or self._ahead or actor.schedule.seqs):
            return self._step([])  # nothing entered, left or steps: nothing to send
        self._rouse()
        tail = self._channel.post(("step", step[0], step[1], state, step[2], step[3]), self._timeout)
        ahead, self._ahead = self._ahead, (step if any(step) else None)
        with self._watch.guard("a batch change", self._timeout):
            failed = apply_step(actor, self._replay, ahead)
        report = self._step(failed)
        if tail:  # after the step, as a follower receives it (`Channel`)
            self._channel.post_tail(tail, self._timeout)
        return report

    def _decide(self, commands: Sequence[Command]) -> Step | None:
        """The next step's commands, decided here alone (None: Shutdown): the engine's
        submits join the queue and admission picks the group that enters; aborts of
        queued requests leave it, the others go to every rank; memory pressure is relieved
        (`GroupCache.pressure_count`); an arrival marks a prompt being prefilled to be
        stored (`GroupReuse`). Nothing of the batch changes here: `apply_step` does that,
        a step later, on every rank."""
        real, reuse, schedule = self._real, self.actor._reuse, self.actor.schedule
        now = time.perf_counter()
        aborts: list[int] = []
        for cmd in commands:
            match cmd:
                case Submit():
                    real.add(cmd, now)
                    reuse.arrived(cmd)
                case Abort(rid=rid):
                    if not real.drop(rid):
                        aborts.append(rid)
                case Shutdown():
                    return None
        ahead = self._ahead
        # A group sent but not applied yet is as good as prefilling: one group at a time.
        prefilling = schedule.prefilling or bool(ahead and ahead[1])
        admitted = tuple(real.due(now, schedule.decoding, prefilling))
        cache = reuse.cache
        evicted = cache.pressure_count() if isinstance(cache, GroupCache) else 0
        marks: tuple[int, ...] = ()
        if isinstance(reuse, GroupReuse) and reuse.marks:
            marks = tuple(reuse.marks)
            reuse.marks.clear()
        return tuple(aborts), admitted, evicted, marks

    def _stop_group(self) -> None:
        """Tell the followers to stop, then apply and step what they hold with them: each has
        queued its receive of "stop" ahead of that step, and runs it before it reads it."""
        self._send(("stop",))
        ahead, self._ahead = self._ahead, None
        with self._watch.guard("stopping the group", self._timeout):
            failed = apply_step(self.actor, self._replay, ahead)
            self._step(failed)

    def _send(self, message: Any) -> None:
        self._rouse()
        self._channel.send(message, self._timeout)
        self._asleep = message[0] == "beat"  # a follower now waits on its wake socket (`_wake.py`)
        if message[0] == "stop":
            self._stopped = True
            self._status.set_all("stopped")

    def _beat(self) -> None:
        self._send(("beat",))

    def _rouse(self) -> None:
        """Before any message that follows a heartbeat: wake the followers waiting for it."""
        if self._asleep:
            self._asleep = False
            if self._wake is not None:
                self._wake.wake()

    def _step(self, failed: list[tuple[int, str]]) -> StepReport:
        actor = self.actor
        stepped = bool(actor.schedule.seqs)  # else no next() (on any rank)
        with self._watch.guard("a decode step", self._timeout):
            report = actor._step(failed)
        if stepped:
            self._digest = token_digest(report)
            self._status.contact()  # the step's collectives (and the message before it) completed
        if self._ahead is not None and self._ahead[1]:  # admitted, entering with the next step
            report = dataclasses.replace(report, live=report.live + len(self._ahead[1]))
        return report


def leader_actor(config: ActorConfig, link: ActorLink, **leader: Any) -> Actor:
    """Rank 0's actor: the usual one, holding a `Leader` (its keywords) as its rank."""
    return Actor(config, link, Leader(config, **leader))
