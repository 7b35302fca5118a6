"""What rank 0 knows about its distributed group: plain Python, no MLX.

A model sharded over several processes (`--distributed tensor|pipeline`,
launched by `mlx.launch`) is served by rank 0's engine and actor; every other
rank runs a follower (`_follower.py`) that mirrors rank 0's steps
(`_distributed.py` says how). `GroupStatus` is what rank 0's actor records
as the group works and what `/health` and `/metrics` read: written on the
actor thread (or the watchdog's), read on the trio thread, each field a
single assignment under the GIL.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

MODES = ("tensor", "pipeline")
BACKENDS = ("any", "ring", "jaccl", "mpi", "nccl")


class GroupError(RuntimeError):
    """The group can no longer serve: a rank died, hung, or fell out of step. Fatal for every rank."""


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
