"""Server processes for the tests that run one (`trio-mlx serve`, hypercorn): the command lines, an
environment that imports this checkout's trio_mlx, and `start()`, which collects a server's stderr
and finds the URL it serves on; and the gRPC health checks that sglang-router's probe sends a
worker, which have ended servers (`grpc_check`, `late_grpc_body`)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

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
        """Collect stderr until the process closes it. Cancelled first (its test's nursery
        ended: the test failed, or was done with the server), it kills the process, so that
        no server outlives its test and loads the tests that follow."""
        assert self.proc.stderr is not None
        try:
            async for chunk in self.proc.stderr:
                self.log += chunk
                if self.url is None and (m := re.search(rb"Running on (http://\S+)", self.log)):
                    self.url = m.group(1).decode()
                    self.has_url.set()
        except trio.Cancelled:
            self.proc.kill()  # a no-op once it has exited (the signal is sent after a poll)
            raise

    @property
    def text(self) -> str:
        return self.log.decode("utf-8", "replace")


async def start(nursery: trio.Nursery, args: list[str], env: dict | None = None) -> Proc:
    proc = await trio.lowlevel.open_process(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                            env=env or ENV, cwd=ROOT)
    p = Proc(proc)
    nursery.start_soon(p.pump)
    return p


def grpc_check(s: socket.socket, port: int) -> Any:
    """An HTTP/2 connection without TLS (the `h2` library's client side) over `s`, with the
    headers of a gRPC health check on stream 1, not sent yet: the connection."""
    import h2.config
    import h2.connection

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, [(":method", "POST"), (":path", "/grpc.health.v1.Health/Check"), (":scheme", "http"),
                          (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"),
                          ("te", "trailers")])
    return conn


def late_grpc_body(port: int) -> None:
    """A gRPC health check whose body comes after the server has answered it and closed the
    stream, as sglang-router's probe sends it now and then (h2 will not send on a closed
    stream: the DATA frame is written by hand). A server that does not speak HTTP/2 just
    closes the connection."""
    import h2.events
    import h2.exceptions

    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        conn = grpc_check(s, port)
        try:
            s.sendall(conn.data_to_send())
            ended = False
            while not ended and (data := s.recv(65536)):
                ended = any(isinstance(e, h2.events.StreamEnded) for e in conn.receive_data(data))
            s.sendall((5).to_bytes(3, "big") + bytes([0x0, 0x1]) + (1).to_bytes(4, "big") + b"\0" * 5)
            while s.recv(65536):
                pass
        except (OSError, h2.exceptions.ProtocolError):
            pass
