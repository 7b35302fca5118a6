"""Grammar checks in worker processes: each check bounded in time and memory, and killable.

Checking a request's grammar against the tokenizer (`_grammar.check_draft`:
llguidance validates it, builds a matcher, takes its first masks and the
shortest completion) takes milliseconds for what clients send, but llguidance
bounds only part of its own work. A JSON schema under 1 KB, a string whose
`allOf` holds 20 patterns such as `.*a.*`, `.*b.*`, took 45 s and 2.3 GB on
the 2-core box (the proof that the patterns' intersection is not empty has a
fixed budget of 10,000 steps, each of which grows with the patterns, and
`LLParserLimits` does not reach it); 500 of them grew past 20 GB and ended in
a Rust panic, a BaseException that took the server down. A thread cannot be
stopped; a process can.

So the engine drafts a grammar's text in a thread (cheap) and checks it here,
in one of a few worker processes (`python -m trio_mlx.engine._grammar_worker`),
each holding the model's tokenizer in llguidance's form (built at its start
from the tokenizer's JSON). A check that runs past `CHECK_SECONDS`, or whose
worker dies (on Linux its address space is capped at `CHECK_MEMORY` bytes
above what it held when the check began; a Rust panic), is a 400 for that request alone:
the worker is killed and the next check starts a fresh one; the same grammar
sent again is refused at once. A check whose request is cancelled (the client
left) kills its worker too. Up to `workers()` checks run at once, each in its
own process, so a slow check holds up no other while fewer than that are slow.

The workers live as long as the server process: a check borrows an idle one
(or starts one, ~0.5 s) and gives it back. A worker exits when its pipe closes
or its parent is gone.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import trio
from trio.lowlevel import RunVar

from .._errors import InvalidRequestError
from ..actor import Grammar
from ._limiters import half_the_cores

log = logging.getLogger("trio_mlx.grammar")

# How long one check may take, in seconds. Arbitrary: what clients send checks in
# milliseconds (a schema of many large tools in tens of them); a grammar that takes
# seconds here takes as long again for each row the actor builds a matcher for.
CHECK_SECONDS = 5.0
# How much memory one check may take beyond what its worker held when it began (Linux;
# elsewhere the time bound alone bounds it: the 20-pattern schema grew ~50 MB/s).
CHECK_MEMORY = 1 << 30
# How long a worker may take to start (import llguidance, build the tokenizer: ~0.5-1.5 s
# on the 2-core box). Arbitrary.
START_SECONDS = 60.0
# How many grammars that timed out or killed their worker are remembered, so that one
# sent again is refused at once. Arbitrary.
_FAILED_SIZE = 256

_HEADER = struct.Struct(">I")
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_SLOTS: RunVar[trio.CapacityLimiter] = RunVar("trio_mlx_grammar_slots")


def workers() -> int:
    """How many checks run at once (each in its own worker): half the CPUs the process may
    use, at least 2."""
    return max(2, half_the_cores())


@dataclass(frozen=True)
class PoolStatistics:
    """What the grammar workers did, in this process, since it started."""

    checks: int  # checks answered by a worker
    timeouts: int  # checks that ran past CHECK_SECONDS
    deaths: int  # workers that died during a check (memory, a panic)
    cancelled: int  # checks whose request was cancelled (their worker killed)
    refused_again: int  # grammars refused at once, having failed before
    started: int  # worker processes started
    idle: int  # workers waiting for a check now


def _what(kind: str) -> str:
    return "the JSON schema" if kind in ("json_schema", "json_object") else "the grammar"


class _Worker:
    """One worker process, used by one check at a time (blocking calls: in a thread)."""

    def __init__(self, source: tuple[str, list[int]]):
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trio_mlx.engine._grammar_worker"],
            # A worker that runs out of memory aborts with Rust's message and backtrace: the
            # server's log gets one line instead (`GrammarPool._fail`).
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
        )
        timer = threading.Timer(START_SECONDS, self.proc.kill)  # a start that hangs fails, not waits
        timer.start()
        try:
            reply = self.ask(("init", *source))
        except BaseException:
            self.kill()
            raise
        finally:
            timer.cancel()
        if reply[0] != "ready":
            self.kill()
            raise RuntimeError(f"a grammar worker failed to start: {reply}")

    def ask(self, message: tuple[Any, ...]) -> tuple[Any, ...]:
        """Send one message and wait for the answer; ("died", how) if the worker exited."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            _write(self.proc.stdin, message)
            reply = _read(self.proc.stdout)
        except (BrokenPipeError, OSError, ValueError):  # ValueError: a pipe closed by `kill`
            reply = None
        if reply is None:
            rc = self.proc.wait()
            return ("died", f"signal {-rc}" if rc < 0 else f"code {rc}")
        return reply  # type: ignore[no-any-return]

    def kill(self) -> None:
        """Kill it; a thread reaps it (a process of many GB takes a while to unmap)."""
        try:
            self.proc.kill()
        except OSError:
            pass
        threading.Thread(target=self.proc.wait, daemon=True, name="trio-mlx-grammar-reap").start()


class GrammarPool:
    """The worker processes of one tokenizer (one model)."""

    def __init__(self, source: tuple[str, list[int]]):
        self._source = source
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()  # the pool is shared by every trio run of the process
        self._failed: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._counts = collections.Counter[str]()
        self._live = 0  # workers started and not yet killed (idle, checking or starting)
        self._starting = 0  # spares starting in the background

    def statistics(self) -> PoolStatistics:
        with self._lock:
            c = self._counts
            return PoolStatistics(c["checks"], c["timeouts"], c["deaths"], c["cancelled"], c["refused_again"],
                                  c["started"], len(self._idle))

    async def check(self, draft: Any) -> Grammar:
        """`_grammar.check_draft(vocab, draft)` in a worker, within CHECK_SECONDS and
        CHECK_MEMORY: the Grammar, or InvalidRequestError."""
        key = hash((draft.source, draft.kind))
        what = f"{draft.param or 'grammar'}: {_what(draft.kind)} cannot be enforced"
        with self._lock:
            reason = self._failed.get(key)
            if reason is not None:
                self._counts["refused_again"] += 1
        if reason is not None:
            raise InvalidRequestError(f"{what}: {reason}", param=draft.param)
        async with _slots():
            worker = await self._borrow()
            reply = None
            try:
                with trio.move_on_after(CHECK_SECONDS):
                    reply = await trio.to_thread.run_sync(
                        worker.ask, ("check", draft.source, draft.kind, draft.param, CHECK_MEMORY),
                        abandon_on_cancel=True)
            except BaseException:  # cancelled: the client left, and the check goes with it
                self._kill(worker)
                with self._lock:
                    self._counts["cancelled"] += 1
                raise
            if reply is None:
                self._kill(worker)
                self._fail(key, what, draft, f"checking it took longer than {CHECK_SECONDS:g} s", "timeouts")
        assert reply is not None
        if reply[0] == "died":
            self._kill(worker)
            self._fail(key, what, draft, "checking it took more memory than the server allows, or "
                              f"crashed the grammar engine (its worker exited with {reply[1]})", "deaths")
        self._give_back(worker)
        if reply[0] == "ok":
            return Grammar(source=draft.source, min_tokens=reply[1], kind=draft.kind)
        if reply[0] == "invalid":
            raise InvalidRequestError(reply[1], param=reply[2])
        raise RuntimeError(f"the grammar check failed: {reply[1]}")

    def _fail(self, key: int, what: str, draft: Any, reason: str, count: str) -> NoReturn:
        log.warning("grammar check refused (%s): %s", draft.param or "grammar", reason)
        with self._lock:
            self._counts[count] += 1
            self._failed[key] = reason
            while len(self._failed) > _FAILED_SIZE:
                self._failed.popitem(last=False)
        raise InvalidRequestError(f"{what}: {reason}", param=draft.param)

    async def _borrow(self) -> _Worker:
        """An idle worker, or a new one; then a spare is started in the background, so
        that the next check finds one ready even while this one runs long."""
        while True:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
                if worker is None:
                    self._live += 1
                    self._counts["started"] += 1
            if worker is None:
                try:
                    worker = await trio.to_thread.run_sync(_Worker, self._source)
                except BaseException:
                    with self._lock:
                        self._live -= 1
                    raise
            elif worker.proc.poll() is not None:  # it died while idle
                with self._lock:
                    self._live -= 1
                continue
            self._top_up()
            return worker

    def _top_up(self) -> None:
        with self._lock:
            if self._idle or self._starting or self._live >= workers():
                return
            self._live += 1
            self._starting += 1
            self._counts["started"] += 1
        threading.Thread(target=self._start_spare, daemon=True, name="trio-mlx-grammar-spare").start()

    def _start_spare(self) -> None:
        try:
            worker: _Worker | None = _Worker(self._source)
        except Exception:
            log.exception("a grammar worker failed to start")
            worker = None
        with self._lock:
            self._starting -= 1
            if worker is not None:
                self._idle.append(worker)
            else:
                self._live -= 1

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            self._counts["checks"] += 1
            if len(self._idle) < workers():
                self._idle.append(worker)
                return
            self._live -= 1
        worker.kill()

    def _kill(self, worker: _Worker) -> None:
        with self._lock:
            self._live -= 1
        worker.kill()
        self._top_up()


_pools: dict[str, GrammarPool] = {}
_pools_lock = threading.Lock()


def grammar_pool(key: str, source: tuple[str, list[int]]) -> GrammarPool:
    """The pool of the tokenizer kept under `key` (the model's path); `source` is
    `_matcher.tokenizer_source`'s answer, which its workers build from."""
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None or pool._source != source:
            pool = _pools[key] = GrammarPool(source)
        return pool


def _slots() -> trio.CapacityLimiter:
    try:
        return _SLOTS.get()
    except LookupError:
        _SLOTS.set(limiter := trio.CapacityLimiter(workers()))
        return limiter


def _write(f: Any, message: Any) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_HEADER.pack(len(body)) + body)
    f.flush()


def _read(f: Any) -> Any:
    """One message, or None at the end of the stream."""
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    body = f.read(n)
    return None if len(body) < n else pickle.loads(body)
