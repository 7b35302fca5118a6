"""The GPU actor in a child process (`actor="process"`): the same answers as the thread actor,
aborts, load failures, a child that dies, and a child that never outlives its engine.

Here a parent killed with SIGKILL; the rest: tests/unit/test_actor_process.py and
tests/integration/test_actor_process.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from processes import alive

ROOT = Path(__file__).resolve().parents[2]


def test_the_actor_process_stops_when_its_server_dies_abruptly(tiny_model_fp32):
    """A parent killed with SIGKILL runs no cleanup: the child sees its pipe close and exits."""
    script = (
        "import os, sys, trio, trio_mlx\n"
        "async def main():\n"
        "    async with trio_mlx.open_engine(sys.argv[1], actor='process') as engine:\n"
        "        print(engine.info.pid, flush=True)\n"
        "        await trio.sleep(60)\n"
        "trio.run(main)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    parent = subprocess.Popen([sys.executable, "-c", script, str(tiny_model_fp32)], stdout=subprocess.PIPE,
                              env=env, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.kill()
        parent.wait(10)
        for _ in range(200):  # the child's parent is gone, so nobody reaps it: wait for its exit
            if not alive(child):
                break
            time.sleep(0.05)
        assert not alive(child)
    finally:
        parent.kill()
