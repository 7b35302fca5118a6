"""File descriptors (server/_connections.py, trio_mlx/_fdlimit.py): the open-file limit is raised, not
lowered by mlx-lm; connections over the cap get a clear 503 at once; slow bodies are cut by the body
timeout; accept errors are logged once in a while, not ten times a second.

Here the pieces alone; the limit and the cap in real processes: tests/system/test_connections.py.
"""

from __future__ import annotations

import logging
import sys

import pytest

from trio_mlx.server._connections import AcceptErrorFilter

pytestmark = pytest.mark.timeout(90)


def test_hypercorn_still_calls_the_handler_the_cap_wraps() -> None:
    import hypercorn.trio.run as run

    assert "TCPServer" in run.worker_serve.__code__.co_names


def test_accept_errors_are_logged_once_per_interval() -> None:
    now = [0.0]
    flt = AcceptErrorFilter(interval=10.0, clock=lambda: now[0])

    def record() -> logging.LogRecord:
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            return logging.LogRecord("trio.serve_listeners", logging.ERROR, __file__, 1,
                                     "accept returned EMFILE; retrying", (), sys.exc_info())

    passed = []
    for i in range(100):  # ten seconds at trio's pace, 10 a second
        now[0] = i * 0.1
        r = record()
        if flt.filter(r):
            passed.append(r)
    now[0] = 10.05
    r = record()
    assert flt.filter(r)
    passed.append(r)
    assert len(passed) == 2 and all(r.exc_info is None for r in passed)
    assert "99 more like it" in passed[1].getMessage()
