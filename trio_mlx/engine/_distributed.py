"""Serving a model sharded over several processes: rank 0's engine, and the way in for the others.

Under `mlx.launch`, `trio-mlx serve MODEL --distributed tensor|pipeline`
starts on every rank. `launched` reads the rank from the launcher's variables,
without MLX: rank 0 builds its engine with `leader_engine` (an ordinary
`Engine` whose thread actor holds `actor._distributed.Leader` as its rank,
which joins the `mx.distributed` group on the actor's own thread) and serves HTTP as always; every
other rank calls `run_follower` instead, which joins the group on the main
thread it follows on, and never starts a server (`actor/_follower.py`).
docs/distributed.md has the whole design.

MLX stays in `actor/`: this module imports it only through the actor package,
and only when `--distributed` is set.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, NoReturn

import trio

from ..actor._group import GroupError as GroupError
from ..actor._group import GroupStatus as GroupStatus
from ._engine import Engine


def launched(backend: str = "any") -> tuple[int, int, str]:
    """(rank, size, backend) of this process in the group `mlx.launch` started, read from
    the launcher's variables without MLX (`actor/_group.launched`). Raises `GroupError`
    outside a group of at least two ranks."""
    from ..actor._group import launched as read

    return read(backend)


def leader_engine(mode: str, *, backend: str = "any", timeout: float = 60.0, startup_timeout: float = 600.0,
                  **engine_options: Any) -> Engine:
    """Rank 0's engine (call it inside trio): `engine.group` is the group's live status.

    `timeout` bounds every collective once serving (a step, a command message),
    `startup_timeout` loading and warm-up; past either the group fails.
    """
    from ..actor._distributed import leader_actor

    rank, size, name = launched(backend)
    if rank != 0:
        raise GroupError(f"rank {rank} cannot serve HTTP: only rank 0 does (start ranks with trio-mlx serve)")
    status = GroupStatus(mode=mode, size=size, backend=name)
    status.set_all("starting")
    token = trio.lowlevel.current_trio_token()
    engine: Engine | None = None

    def on_failure(reason: str) -> None:  # from the actor thread or the watchdog's
        if engine is not None:
            trio.from_thread.run_sync(engine.fail, f"the distributed group failed: {reason}", trio_token=token)

    def actor(config: Any, link: Any) -> Any:
        return leader_actor(config, link, backend=name, mode=mode, status=status, timeout=timeout,
                            startup_timeout=startup_timeout, on_failure=on_failure)

    engine_options.pop("actor", None)  # always a thread actor: rule 1 holds its collectives
    # No restarts: the followers stop with a failed leader, and MLX keeps the group of the
    # thread that first joined it, which a new actor thread could not use.
    engine_options["restart_limit"] = 0
    engine = Engine(actor=actor, **engine_options)
    engine.group = status
    return engine


def run_follower(model: str | None, *, cache_dir: str | None, backend: str = "any", timeout: float = 60.0,
                 startup_timeout: float = 600.0) -> int:
    """Serve as a follower rank until rank 0 stops the group; the process's exit status."""
    from ..actor._follower import follower_main

    return follower_main(model, cache_dir=cache_dir, backend=backend, timeout=timeout,
                         startup_timeout=startup_timeout)


def leave(status: int) -> NoReturn:
    """End this rank's process now, with `status`, once its work is done and its logs flushed.

    MLX's distributed backends keep threads of their own (the ring backend's), and a
    process that returns normally runs C++ static destructors while one may still be
    alive: after a clean stop, rank 0 sometimes aborted with "terminate called without
    an active exception" (status -6; tests/system/test_distributed.py's SIGTERM test under load).
    Nothing is left to run at that point, so the rank skips the destructors."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing left to flush
            pass
    os._exit(status)
