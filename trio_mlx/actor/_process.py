"""The GPU actor in a child process, so its Python work has a GIL of its own.

`Engine(actor="process")` runs `_actor.Actor` here instead of on a thread of
the server's process. The actor is the same object with the same loop; only
its link to the engine differs: a pipe instead of `from_thread` calls. The
child writes one frame per step (the step's report) and never waits for the
event loop; commands (submit, abort, shutdown) are forwarded by the engine as
they arrive and read by the child between steps, without blocking while it
has sequences. When the batch is empty it blocks reading its pipe, and an end
of file (the server went away, however abruptly) is a shutdown.

Why: decode on a host-bound GPU (kernel launches dominate each step) is
Python work on the actor thread, and with a thread actor every microsecond the
event loop spends on HTTP, SSE and detokenizing is taken from it under the
shared GIL (docs/design.md, rule 7; BENCHMARKS.md, "What limits performance now").

Frames are a 4-byte big-endian length and a pickle. Step reports travel as
plain tuples: pickling the slotted dataclasses costs ~10x more per token.

The parent side (`run_actor_process`) imports no MLX; the child imports it
through `_actor`, the only module that touches MLX arrays.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from .._errors import ModelLoadError
from ._protocol import ActorInfo, Command, Shutdown, StepReport, TokenOut

_HEADER = struct.Struct(">I")
# The child imports this trio_mlx, however the parent imported it (a checkout, a test's sys.path).
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class ActorProcessError(RuntimeError):
    """The actor process failed: its own error, as "Type: message", or how it exited."""


# ---- wire format -------------------------------------------------------------


def _frame(obj: Any) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def _encode_report(r: StepReport) -> tuple[Any, ...]:
    toks = tuple((t.rid, t.token, t.finish_reason, t.logprob, t.top_logprobs) for t in r.tokens)
    return ("step", toks, r.prefilling, r.decoding, r.failed, r.prompt_tokens, r.step_seconds, r.live, r.memory,
            r.cached, r.prompt_cache, r.speculated)


def _decode_report(m: tuple[Any, ...]) -> StepReport:
    _, toks, prefilling, decoding, failed, prompt_tokens, step_seconds, live, memory, cached, pcache, spec = m
    return StepReport(tuple(TokenOut(*t) for t in toks), prefilling, decoding, failed, prompt_tokens,
                      step_seconds, live, memory, cached, pcache, spec)


class _Frames:
    """Splits a byte stream into unpickled frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes | bytearray) -> list[Any]:
        self._buf += data
        out = []
        while len(self._buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self._buf)
            if len(self._buf) < _HEADER.size + n:
                break
            out.append(pickle.loads(bytes(self._buf[_HEADER.size:_HEADER.size + n])))
            del self._buf[:_HEADER.size + n]
        return out


# ---- the child -----------------------------------------------------------------


class PipeLink:
    """The actor's side: reports out on `wfd`, commands in on `rfd`; blocking only when idle."""

    def __init__(self, rfd: int, wfd: int):
        self._rfd, self._wfd = rfd, wfd
        self._frames = _Frames()
        self._early: list[Any] = []  # frames that came in with the config
        self._eof = False

    def config(self) -> Any:
        """The first frame (the ActorConfig), waiting for it; None if the engine went away first."""
        while not self._early:
            data = os.read(self._rfd, 1 << 16)
            if not data:
                return None
            self._early = self._frames.feed(data)
        return self._early.pop(0)

    def _write(self, obj: Any) -> None:
        data = memoryview(_frame(obj))
        while data:
            data = data[os.write(self._wfd, data):]

    def _read(self, timeout: float | None) -> list[Command]:
        """Whatever commands have arrived; waits up to `timeout` (None: until one does)."""
        out: list[Command] = [c for batch in self._early for c in batch]
        self._early.clear()
        while not out and not self._eof:
            ready, _, _ = select.select([self._rfd], [], [], timeout)
            if not ready:
                break
            data = os.read(self._rfd, 1 << 16)
            if not data:
                self._eof = True
                break
            for batch in self._frames.feed(data):
                out.extend(batch)
        if self._eof:
            out.append(Shutdown())  # the engine is gone: stop, however it went
        return out

    def ready(self, info: ActorInfo) -> None:
        self._write(("ready", info))

    def exchange(self, report: StepReport) -> list[Command]:
        if report != _EMPTY:
            self._write(_encode_report(report))
        return self._read(0)

    def wait_commands(self, timeout: float | None = None) -> list[Command]:
        return self._read(timeout)

    def check(self) -> None:
        pass  # cancellation reaches the child as Shutdown or end of file

    def built(self) -> None:
        pass  # the event loop has a GIL of its own

    def died(self, exc: BaseException) -> None:
        try:
            self._write(("died", type(exc).__name__, str(exc)))
        except OSError:
            pass


_EMPTY = StepReport()
# The parent's log level, for the child's logging (an internal variable, not a setting).
_LOG_LEVEL = "_TRIO_MLX_ACTOR_LOG_LEVEL"


def child_main() -> int:
    # Ctrl-C reaches the whole process group; the server decides when the actor
    # stops (it sends Shutdown, or its end of the pipe closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rfd = os.dup(0)
    wfd = os.dup(1)
    os.dup2(2, 1)  # stray prints from libraries go to stderr, not into the frames
    # The actor's log lines (its startup stages) go to stderr, at the server's level.
    logging.basicConfig(level=os.environ.get(_LOG_LEVEL, "WARNING"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s (actor process): %(message)s")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    link = PipeLink(rfd, wfd)
    config = link.config()
    if config is None:
        return 0
    # trio_mlx.models first: it loads OpenBLAS under MLX's Linux CPU wheel, which only works
    # before anything imports mlx.core, and `_actor` imports mlx.core before it (the child
    # reported the reference BLAS, "mlx was imported before trio_mlx.models").
    from .. import models  # noqa: F401
    from ._actor import Actor

    try:
        Actor(config, link).run()
    except BaseException as exc:
        link.died(exc)
        return 1
    return 0


# ---- the parent ----------------------------------------------------------------


async def run_actor_process(
    config: Any,
    *,
    ready: Callable[[ActorInfo], None],
    deliver: Callable[[StepReport], None],
    wait_commands: Callable[[], Any],
    shutdown_timeout: float = 30.0,
) -> None:
    """Run the actor in a child process until it stops; raises ActorProcessError if it fails.

    `ready`, `deliver` and `wait_commands` are the engine's (`Engine.ready`,
    `Engine.deliver`, `Engine.wait_commands`). Cancelled, it closes the child's
    pipe (which stops it) and waits up to `shutdown_timeout` seconds before
    killing it.
    """
    env = {**os.environ, _LOG_LEVEL: logging.getLevelName(logging.getLogger("trio_mlx").getEffectiveLevel()),
           "PYTHONPATH": os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)}
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trio_mlx.actor._process"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout
    error: list[str] = []
    try:
        await stdin.send_all(_frame(config))
        async with trio.open_nursery() as nursery:

            async def forward() -> None:
                while True:
                    commands = await wait_commands()
                    try:
                        await stdin.send_all(_frame(commands))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        return  # the child is gone; the reader says why
                    if any(isinstance(c, Shutdown) for c in commands):
                        return

            nursery.start_soon(forward)
            frames = _Frames()
            async for data in stdout:
                for m in frames.feed(data):
                    kind = m[0]
                    if kind == "step":
                        deliver(_decode_report(m))
                    elif kind == "ready":
                        ready(m[1])
                    elif kind == "died":
                        error.append(f"{m[1]}: {m[2]}")
            nursery.cancel_scope.cancel()  # end of file: the child is stopping
    finally:
        with trio.CancelScope(shield=True):
            # Closing our end is the shutdown that always works: a cancelled
            # send may have left half a frame in the pipe.
            await stdin.aclose()
            if proc.returncode is None:
                with trio.move_on_after(shutdown_timeout):
                    await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await stdout.aclose()
    if error:
        kind, _, message = error[0].partition(": ")
        if kind == "ModelLoadError":
            raise ModelLoadError(message)
        raise ActorProcessError(error[0])
    rc = proc.returncode
    if rc != 0:
        how = f"signal {-rc}" if rc is not None and rc < 0 else f"code {rc}"
        raise ActorProcessError(f"the actor process exited with {how}")


if __name__ == "__main__":
    sys.exit(child_main())
