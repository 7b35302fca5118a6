"""The request trace: one tab-separated line per completion request, written beside the
step trace (`--step-trace FILE` makes FILE.requests too), on the step trace's clock.

The step trace tells when the actor stepped and how many sequences were live; it cannot
tell when each request reached the server, how long its intake took (parsing, the chat
template, tokenizing, the wait for a slot), or when its first token left. Those are in
each request's `RequestRecord`, in trio's clock. Written here in `time.perf_counter()`'s
clock (the step trace's, also across the process actor's boundary on Linux and macOS),
a request lines up with the steps it waited through: the gap between a wave's answers
ending and its clients' next requests arriving, for one, which admission's wait for a
returning wave is sized against (`actor/_admission.py`).
"""

from __future__ import annotations

import time
from typing import IO

import trio

from ._records import RequestRecord


def request_trace_path(step_trace: str) -> str:
    """Where the request trace goes, given the step trace's path."""
    return step_trace + ".requests"


class RequestTrace:
    """Appends a line per request as it ends (an app observer); open it on the trio thread."""

    HEADER = ("arrived\tintake_s\tttft_s\te2e_s\tprompt_tokens\tcached_tokens\tcompletion_tokens\t"
              "endpoint\toutcome\trequest_id\n")

    def __init__(self, path: str):
        self._f: IO[str] | None = open(path, "a", buffering=1 << 16)  # closed in close()
        self._f.write(self.HEADER)

    def observe(self, rec: RequestRecord) -> None:
        if self._f is None:
            return
        offset = time.perf_counter() - trio.current_time()  # both monotonic, one rate

        def since(t: float | None) -> str:
            return "" if t is None else f"{t - rec.arrived:.6f}"

        self._f.write(f"{rec.arrived + offset:.6f}\t{since(rec.admitted)}\t{since(rec.first_token)}\t"
                      f"{since(rec.ended)}\t{rec.prompt_tokens}\t{rec.cached_tokens}\t"
                      f"{rec.completion_tokens}\t{rec.endpoint}\t{rec.outcome}\t{rec.request_id}\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
