"""Server processes for the tests that run one (`trio-mlx serve`, hypercorn): the command lines, an
environment that imports this checkout's trio_mlx, and `start()`, which collects a server's stderr
and finds the URL it serves on."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
SERVE = [sys.executable, "-m", "trio_mlx.cli", "serve"]
HYPERCORN = [sys.executable, "-m", "hypercorn"]


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Proc:
    """A server subprocess whose stderr is collected while it runs."""

    def __init__(self, proc: trio.Process):
        self.proc = proc
        self.log = b""
        self.url: str | None = None
        self.has_url = trio.Event()

    async def pump(self) -> None:
        assert self.proc.stderr is not None
        async for chunk in self.proc.stderr:
            self.log += chunk
            if self.url is None and (m := re.search(rb"Running on (http://\S+)", self.log)):
                self.url = m.group(1).decode()
                self.has_url.set()

    @property
    def text(self) -> str:
        return self.log.decode("utf-8", "replace")


async def start(nursery: trio.Nursery, args: list[str], env: dict | None = None) -> Proc:
    proc = await trio.lowlevel.open_process(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                            env=env or ENV, cwd=ROOT)
    p = Proc(proc)
    nursery.start_soon(p.pump)
    return p
