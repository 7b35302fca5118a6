"""What a rank knows about its distributed group without MLX: its place, and rank 0's status.

A model sharded over several processes (`--distributed tensor|pipeline`,
launched by `mlx.launch`) is served by rank 0's engine and actor; every other
rank runs a follower (`_follower.py`) that mirrors rank 0's steps
(`_distributed.py` says how). `GroupStatus` is what rank 0's actor records
as the group works and what `/health` and `/metrics` read: written on the
actor thread (or the watchdog's), read on the trio thread, each field a
single assignment under the GIL.

`launched` reads a rank's number, the group's size and its backend from the
variables `mlx.launch` (or `mpirun`) sets, without MLX: the process's main
thread decides with it whether to serve HTTP or follow, and only the thread
that will use the group joins it (`_distributed.init_group`), the one that
holds all of the rank's MLX state (docs/design.md, rule 1).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

MODES = ("tensor", "pipeline")
BACKENDS = ("any", "ring", "jaccl", "mpi", "nccl")


class GroupError(RuntimeError):
    """The group can no longer serve: a rank died, hung, or fell out of step. Fatal for every rank."""


def env_backend() -> str:
    """The backend `mlx.launch` set up, from the variables it exports ("any": none of them)."""
    env = os.environ
    if "MLX_JACCL_COORDINATOR" in env or "MLX_IBV_DEVICES" in env:
        return "jaccl"
    if "NCCL_PORT" in env:
        return "nccl"
    if "MLX_HOSTFILE" in env:
        return "ring"
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        return "mpi"
    return "any"


_LAUNCH_HINT = ("start every rank with mlx.launch, e.g. `mlx.launch --backend ring -n 2 -- trio-mlx serve MODEL "
                "--distributed tensor`")


def launched(backend: str = "any") -> tuple[int, int, str]:
    """(this process's rank, the group's size, the backend's name), read from the variables
    the launcher set (MLX_RANK and MLX_HOSTFILE, MLX_WORLD_SIZE or MLX_IBV_DEVICES; MPI's
    own), without MLX. Raises GroupError outside a group of at least two ranks."""
    env = os.environ
    name = env_backend() if backend == "any" else backend
    if name == "any":
        raise GroupError(f"not started as a rank of a distributed group (none of the launcher's variables "
                         f"is set); {_LAUNCH_HINT}")
    try:
        if name == "mpi":
            rank = int(env.get("OMPI_COMM_WORLD_RANK") or env["PMI_RANK"])
            size = int(env.get("OMPI_COMM_WORLD_SIZE") or env["PMI_SIZE"])
        else:
            rank = int(env["MLX_RANK"])
            if name == "nccl":
                size = int(env["MLX_WORLD_SIZE"])
            elif name in ("ring", "jaccl"):
                path = env["MLX_HOSTFILE" if name == "ring" else "MLX_IBV_DEVICES"]
                with open(path, encoding="utf-8") as f:
                    text = f.read().strip()
                size = len(json.loads(text)) if text else 1  # mlx.launch writes "" for one rank
            else:
                raise GroupError(f"unknown distributed backend {name!r}")
    except KeyError as exc:
        raise GroupError(f"not started as a rank of a distributed group (backend {name}: {exc.args[0]} is "
                         f"not set); {_LAUNCH_HINT}") from None
    except (OSError, ValueError) as exc:
        raise GroupError(f"could not read this rank's place in the group (backend {name}): {exc}") from None
    if size < 2:
        raise GroupError("--distributed needs at least 2 ranks: start them with mlx.launch "
                         "(e.g. `mlx.launch --hostfile hosts.json -- trio-mlx serve MODEL --distributed tensor`)")
    if not 0 <= rank < size:
        raise GroupError(f"rank {rank} is outside a group of {size}")
    return rank, size, name


@dataclass
class GroupStatus:
    """The group as rank 0 sees it."""

    mode: str
    size: int = 1
    backend: str = "?"
    # One state per rank: "starting", "loading", "serving" (rank 0), "following",
    # "stopped" (told to stop), "lost" (the group failed).
    ranks: list[str] = field(default_factory=list)
    error: str | None = None
    messages: int = 0  # command messages sent to the followers (heartbeats included)
    message_bytes: int = 0
    _contact: float = field(default_factory=time.monotonic)

    def set_all(self, state: str, *, leader: str | None = None) -> None:
        self.ranks = [leader or state] + [state] * (self.size - 1)

    def contact(self) -> None:
        self._contact = time.monotonic()

    def failed(self, reason: str) -> None:
        if self.error is None:
            self.error = reason
        self.set_all("lost")

    def snapshot(self) -> dict[str, Any]:
        return {"mode": self.mode, "size": self.size, "backend": self.backend,
                "ranks": [{"rank": i, "state": s} for i, s in enumerate(self.ranks)],
                "seconds_since_contact": round(time.monotonic() - self._contact, 3),
                "error": self.error}

    def describe(self) -> str:
        """The split, for the ready log."""
        what = (f"tensor parallel: every rank holds 1/{self.size} of each layer" if self.mode == "tensor"
                else "pipeline parallel: each rank holds a run of layers")
        others = "rank 1 follows" if self.size == 2 else f"ranks 1-{self.size - 1} follow"
        return f"{self.size} ranks over {self.backend}, {what}; rank 0 serves HTTP, {others} its steps"
