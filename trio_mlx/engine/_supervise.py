"""When a dead GPU actor is started again: the restart budget and its backoff.

An actor dies when its process is killed (the process actor: SIGKILL, the OOM
killer, a crash in MLX) or when its loop raises outside a step's recovery
(the thread actor). The engine ends every request in flight at once
(docs/design.md, rule 8), then starts a fresh actor, which loads the model and
warms up again, after a backoff that doubles with each recent restart. Past
`limit` restarts within `window` seconds the engine gives up and is broken:
something is wrong that another restart will not fix, and the process
supervisor (systemd, Kubernetes) is better placed to act, so the server exits
non-zero.

Not recoverable, and so not covered: a segfault or an abort in MLX on the
thread actor takes the whole server process with it (the process actor
contains it: only its child dies).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

# The longest wait between two restarts, whatever the backoff says. Judgement.
MAX_BACKOFF = 30.0


@dataclass
class RestartBudget:
    """At most `limit` restarts within any `window` seconds; the n-th recent one waits
    `backoff * 2**(n-1)` seconds (at most MAX_BACKOFF)."""

    limit: int = 3
    window: float = 300.0
    backoff: float = 1.0
    _times: collections.deque[float] = field(default_factory=collections.deque)

    def __post_init__(self) -> None:
        if self.limit < 0 or not self.window > 0 or not self.backoff >= 0:
            raise ValueError("restart_limit must be >= 0, restart_window > 0 and restart_backoff >= 0")

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before restarting now, or None when the budget is spent."""
        while self._times and now - self._times[0] > self.window:
            self._times.popleft()
        if len(self._times) >= self.limit:
            return None
        delay = min(self.backoff * 2 ** len(self._times), MAX_BACKOFF)
        self._times.append(now)
        return delay
