"""Connections (server/_connections.py, trio_mlx/_fdlimit.py): the open-file limit is raised, not
lowered by mlx-lm; connections over the cap get a clear 503 at once; slow bodies are cut by the body
timeout; accept errors are logged once in a while, not ten times a second.

Here in real processes; the pieces alone: tests/unit/test_connections.py.
"""

from __future__ import annotations

import re
import resource
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import trio
from processes import ENV, SERVE, Proc, grpc_check, late_grpc_body, start

pytestmark = pytest.mark.timeout(90)


def _limits(soft: int, hard: int):  # noqa: ANN202 - a preexec_fn
    def set_limits() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return set_limits


def test_importing_mlx_lm_through_trio_mlx_keeps_the_limit() -> None:
    code = ("import resource, trio_mlx, mlx_lm.generate, trio_mlx.models;"
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60,
                         preexec_fn=_limits(1000, 8000))
    # mlx-lm alone sets (2048, 4096): the hard limit could never come back
    assert out.stdout.split() == ["2048", "8000"], out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60,
                         preexec_fn=_limits(6000, 8000))
    assert out.stdout.split() == ["6000", "8000"], out.stdout + out.stderr


async def test_connections_over_the_cap_get_503_at_once_and_slow_bodies_are_cut(tiny_model_fp32) -> None:
    async with trio.open_nursery() as nursery:
        proc_args = [*SERVE, str(tiny_model_fp32), "--port", "0", "--no-warmup", "--no-access-log",
                     "--max-connections", "30", "--body-timeout", "2"]
        # a low soft limit, as a login shell may give: the server raises it to the hard one
        p = await start(nursery, ["sh", "-c", 'ulimit -S -n 1000 && exec "$@"', "sh", *proc_args])
        held: list[socket.socket] = []
        try:
            with trio.fail_after(60):
                await p.has_url.wait()
            port = int((p.url or "").rsplit(":", 1)[1])
            soft, hard = re.search(r"Max open files\s+(\d+)\s+(\d+)",  # type: ignore[union-attr]
                                   open(f"/proc/{p.proc.pid}/limits").read()).groups()  # noqa: ASYNC230
            assert soft == hard and int(soft) > 1000, (soft, hard)  # raised to the hard limit at startup
            head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                    "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{").encode()
            for _ in range(30):  # slow bodies: headers and one byte, then nothing
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(head)
                held.append(s)
            await trio.sleep(0.5)
            t0 = trio.current_time()
            for _ in range(20):
                s = socket.create_connection(("127.0.0.1", port))
                s.settimeout(5)
                s.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
                answer = b""
                while chunk := s.recv(65536):
                    answer += chunk
                s.close()
                assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer, answer
                assert b"retry-after: 1" in answer.lower()
            assert trio.current_time() - t0 < 5
            # the body timeout cuts the slow ones with 408, and the server serves again
            for s in held:
                s.settimeout(10)
                assert s.recv(65536).startswith(b"HTTP/1.1 408"), "the body timeout"
            await trio.sleep(0.3)
            async with httpx.AsyncClient(base_url=p.url or "", timeout=30) as client:
                r = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
                assert r.status_code == 200, r.text
            assert len(re.findall("refused .* with 503", p.text)) == 1, p.text  # one line for 20 refusals
            assert "Traceback" not in p.text
        finally:
            for s in held:
                s.close()
            nursery.cancel_scope.cancel()  # kills the server (`processes.start`)


def _probe_then_goaway(port: int) -> None:
    """What sglang-router's gRPC health check does to a worker that speaks HTTP: an HTTP/2
    request without TLS, and the connection ended (GOAWAY) as soon as the answer's headers
    come, while the server is still writing its body."""
    import h2.events

    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        conn = grpc_check(s, port)
        conn.send_data(1, b"\0\0\0\0\0", end_stream=True)
        s.sendall(conn.data_to_send())
        answered = False
        while not answered and (data := s.recv(65536)):
            answered = any(isinstance(e, h2.events.ResponseReceived) for e in conn.receive_data(data))
        conn.close_connection()
        s.sendall(conn.data_to_send())


async def _probed(model: Path, probe: Callable[[int], None], times: int) -> Proc:
    """A `trio-mlx serve` that `probe(port)` hit `times` times and that then answered
    `/health` with 200: the process, its log collected."""
    async with trio.open_nursery() as nursery:
        p = await start(nursery, [*SERVE, str(model), "--port", "0", "--no-warmup", "--no-access-log"])
        try:
            with trio.fail_after(60):
                await p.has_url.wait()
            port = int((p.url or "").rsplit(":", 1)[1])
            for _ in range(times):
                await trio.to_thread.run_sync(probe, port)
            async with httpx.AsyncClient(base_url=p.url or "", timeout=30) as client:
                assert (await client.get("/health")).status_code == 200
            assert p.proc.returncode is None, p.text[-3000:]
            return p
        finally:
            nursery.cancel_scope.cancel()  # kills the server (`processes.start`)


async def test_http2_probes_that_hang_up_mid_answer_leave_the_server_serving(tiny_model_fp32) -> None:
    """Hypercorn half-closed such a connection beside the send of its answer's body, and the
    BusyResourceError that trio raised ended the whole server (server/_connections.py,
    `OneSender`): it took at most some 50 probes."""
    p = await _probed(tiny_model_fp32, _probe_then_goaway, 200)
    assert "BusyResourceError" not in p.text, p.text[-3000:]


async def test_a_request_body_after_its_answer_leaves_the_server_serving(tiny_model_fp32) -> None:
    """Hypercorn 0.18 raises KeyError for HTTP/2 data on a stream it has answered and closed,
    and its trio worker let that end the whole server, at the first such connection
    (server/_connections.py, `ConnectionGate`). Now the connection ends alone, in one warning
    line for all of them."""
    p = await _probed(tiny_model_fp32, late_grpc_body, 5)
    assert len(re.findall("ended by an error inside the HTTP server", p.text)) == 1, p.text[-3000:]
    assert "Traceback" not in p.text
