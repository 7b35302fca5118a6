"""The tests' server helper (`tests/processes.py`): a server it started ends with its test."""

from __future__ import annotations

import signal
import sys

import trio
from processes import start

# A stand-in server: announces a URL, then runs a minute unless stopped.
LINGERING = "import sys, time; sys.stderr.write('Running on http://127.0.0.1:1\\n'); sys.stderr.flush(); time.sleep(60)"


async def test_a_server_still_running_when_its_tests_nursery_ends_is_killed() -> None:
    """A test that fails (or is done) with its server up cancels the nursery: the server dies
    with it, where it once ran on and loaded the tests after it."""
    async with trio.open_nursery() as nursery:
        p = await start(nursery, [sys.executable, "-c", LINGERING])
        with trio.fail_after(30):
            await p.has_url.wait()
        nursery.cancel_scope.cancel()
    with trio.fail_after(10):
        rc = await p.proc.wait()
    assert rc == -signal.SIGKILL and p.url == "http://127.0.0.1:1"


async def test_a_server_that_exited_is_left_as_it_ended() -> None:
    """Cancelling after the server's own exit signals nothing: its status stays its own."""
    async with trio.open_nursery() as nursery:
        p = await start(nursery, [sys.executable, "-c", "import sys; sys.exit(3)"])
        with trio.fail_after(30):
            rc = await p.proc.wait()
        nursery.cancel_scope.cancel()
    assert rc == 3 and p.proc.returncode == 3
