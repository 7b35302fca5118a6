"""A server that cannot start exits non-zero, whatever ASGI server runs it.

Alone in its process (`trio-mlx serve`, uvicorn with one worker, a program that
embeds the app) the app lets a startup failure propagate: the lifespan reports
`startup.failed` and the server exits non-zero on its own (trio-mlx serve 1,
uvicorn 3). A worker process under a supervisor is another matter:

- hypercorn's supervisor (0.18) exits 0 whatever its workers did: `run()`
  recomputes the exit code over the workers still running, and there are none
  (hypercorn issue #269). It handles SIGINT and SIGTERM by stopping, also with 0;
- uvicorn's (`--workers N`) stops every worker when one exits 3, then exits 0;
- granian's exits 1 when a worker exits unexpectedly: nothing more is needed.

And hypercorn's asyncio worker checks whether the lifespan failed the moment
startup is reported; through the guest-mode bridge the failure reaches it a few
loop turns later, so alone in its process (`-w 0`, `hypercorn.asyncio.serve`)
it would go on serving an app without a model.

So a supervised worker that cannot start, or an unsupervised hypercorn
asyncio worker, writes its one line and ends the server itself. Under a
hypercorn or uvicorn supervisor: the supervisor gets SIGKILL (the one signal
it neither handles nor turns into a clean exit: the shell sees 137), then the
sibling worker that holds the model's lock, if any, gets SIGTERM (what the
supervisor would send it), and the worker leaves with `os._exit(3)`, the status
uvicorn and gunicorn read as "worker failed to boot". `os._exit`, not an
exception: the failure happened inside the lifespan, half-way through starting
the trio run and the GPU actor, and an exception there only becomes a
traceback and a status the supervisor drops. With
TRIO_MLX_ALLOW_MULTIPLE_WORKERS=1 other workers may be serving, so the
supervisor is left alone and decides; under a reloader (development) too.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

STARTUP_FAILURE = 3  # gunicorn's WORKER_BOOT_ERROR and uvicorn's STARTUP_FAILURE
# Supervisors that exit 0 after a worker failed at startup (see above).
_SWALLOWING = ("hypercorn", "uvicorn")


@dataclass(frozen=True)
class ServerInfo:
    """The ASGI server running the app, read off its lifespan `receive` (a method of its lifespan
    object: `hypercorn.asyncio.lifespan.Lifespan`, `uvicorn.lifespan.on.LifespanOn`, ...)."""

    module: str = ""  # "hypercorn.asyncio.lifespan", "uvicorn.lifespan.on", ...; "" when not known
    reload: bool = False

    @property
    def name(self) -> str:
        return self.module.partition(".")[0]

    @classmethod
    def of(cls, receive: Any) -> ServerInfo:
        owner = getattr(receive, "__self__", None)
        if owner is None:
            return cls()
        config = getattr(owner, "config", None)
        reload = bool(getattr(config, "use_reloader", False) or getattr(config, "reload", False))
        return cls(type(owner).__module__, reload)


def exit_if_unseen(server: ServerInfo, message: str, *, lock_holder: tuple[int, int] | None = None,
                   others_may_serve: bool = False) -> None:
    """Where the server would not exit non-zero on a failed startup (above): write `message`,
    stop the server, exit 3 (no return). Anywhere else, return: the caller raises and the server
    reports the failed lifespan.

    `lock_holder` is (pid, parent pid) of the process that serves the model, when that is why
    this one cannot start."""
    parent = multiprocessing.parent_process()
    supervised = parent is not None and parent.pid == os.getppid()
    if server.reload or not (supervised or server.module.startswith("hypercorn.asyncio.")):
        return
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    if supervised and server.name in _SWALLOWING and not others_may_serve:
        supervisor = os.getppid()
        # The supervisor first: a worker that ended while it still ran (this one preempted
        # between the two signals) would let it see an exit and return 0.
        _signal(supervisor, signal.SIGKILL)
        if lock_holder is not None and lock_holder[1] == supervisor and lock_holder[0] != os.getpid():
            _signal(lock_holder[0], signal.SIGTERM)
    os._exit(STARTUP_FAILURE)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass  # gone already (another worker got there first)


def exit_failed(server: ServerInfo, message: str) -> NoReturn:
    """The app cannot serve on (its engine broke for good): write `message` and end the process
    with 1, whatever server runs it. Under hypercorn's supervisor, which would exit 0 once its
    worker is gone (above), the supervisor gets SIGKILL first, so that the exit status says it."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid == os.getppid() and server.name == "hypercorn" and not server.reload:
        _signal(os.getppid(), signal.SIGKILL)
    os._exit(1)
