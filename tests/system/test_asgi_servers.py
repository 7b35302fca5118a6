"""`trio_mlx.app:app` under every ASGI server: one matrix, each server a real process on 127.0.0.1.

`hypercorn -k trio` runs the app natively; hypercorn's default asyncio worker,
uvicorn and granian run it through trio's guest mode (`trio_mlx/_guest.py`).
Under each: the openai SDK gets its answers, streamed and not; a client that
disconnects mid-decode frees its slot at once; a client that stops reading is
cut after the stall timeout; SIGTERM lets an in-flight stream finish; a model
that cannot load, or a second worker that would load it again, makes the
server exit non-zero. One server process per kind serves the first tests (the
SIGTERM test ends it); startup failures run their own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trio
from app_server import CHAT, HELLO, Scrape, open_raw
from processes import alive, late_grpc_body

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
APP = "trio_mlx.app:app"
# name: (command before the app, how to ask for two workers)
SERVERS = {
    # --graceful-timeout: hypercorn cuts in-flight requests 3 s after SIGTERM by default.
    "hypercorn-trio": ([PY, "-m", "hypercorn", "-k", "trio", "-b", "127.0.0.1:0", "--graceful-timeout", "30"],
                       ["-w", "2"]),
    "hypercorn-asyncio": ([PY, "-m", "hypercorn", "-b", "127.0.0.1:0", "--graceful-timeout", "30"], ["-w", "2"]),
    "uvicorn": ([PY, "-m", "uvicorn", "--host", "127.0.0.1", "--port", "0", "--no-access-log"], ["--workers", "2"]),
    "granian": ([PY, "-m", "granian", "--interface", "asgi", "--host", "127.0.0.1", "--port", "0"],
                ["--workers", "2"]),
}
# The status each server exits with after a SIGTERM that drained: uvicorn re-raises the signal
# once it has shut down gracefully, so its process ends by SIGTERM (the shell sees 143).
DRAINED_STATUS = {"hypercorn-trio": 0, "hypercorn-asyncio": 0, "uvicorn": -signal.SIGTERM, "granian": 0}
REFUSED = "another trio_mlx server process (pid "
STALL_TIMEOUT = 0.5


def installed(name: str) -> bool:
    return importlib.util.find_spec(name.split("-")[0]) is not None


KINDS = [pytest.param(k, marks=pytest.mark.skipif(not installed(k), reason=f"{k} is not installed"))
         for k in SERVERS]


def server_env(model: Path | str, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TRIO_MLX_MODEL": str(model), "TRIO_MLX_WARMUP": "0", "TRIO_MLX_MAX_BATCH": "8",
           "TRIO_MLX_STALL_TIMEOUT": str(STALL_TIMEOUT), **extra}
    env.pop("TRIO_MLX_ACTOR", None)  # the default, a thread
    return env


class ServerProcess:
    """An ASGI server subprocess; its stderr is collected by a thread; `url` once it listens."""

    def __init__(self, kind: str, model: Path):
        self.kind = kind
        self.proc = subprocess.Popen([*SERVERS[kind][0], APP], env=server_env(model), cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.log = b""
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            self.url = self._wait_listening(45)
        except BaseException:
            self.stop()  # SIGTERM first: a supervisor killed outright would leave its worker behind
            raise

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log += line

    @property
    def text(self) -> str:
        return self.log.decode("utf-8", "replace")

    def _wait_listening(self, within: float) -> str:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.kind} exited {self.proc.returncode}:\n{self.text[-3000:]}")
            port = self._port()
            if port and httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return f"http://127.0.0.1:{port}"
            time.sleep(0.05)
        raise AssertionError(f"{self.kind} did not start:\n{self.text[-3000:]}")

    def _port(self) -> int | None:
        if m := re.search(r"Running on http://127\.0\.0\.1:(\d+)|Uvicorn running on http://127\.0\.0\.1:(\d+)",
                          self.text):
            return int(m.group(1) or m.group(2))
        if self.kind == "granian":
            # granian logs the port it was given (0); ask the system which one it got.
            import psutil

            try:
                for p in [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]:
                    for c in p.net_connections("tcp"):
                        if c.status == psutil.CONN_LISTEN:
                            return int(c.laddr.port)
            except (psutil.Error, OSError):
                pass  # a process of its tree came or went meanwhile: ask again
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module", params=KINDS)
def server(request: pytest.FixtureRequest, tiny_model_fp32: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(request.param, tiny_model_fp32)
    try:
        yield proc
    finally:
        proc.stop()


async def metrics(client: httpx.AsyncClient) -> Scrape:
    r = await client.get("/metrics")
    assert r.status_code == 200, r.text
    return Scrape(r.text)


async def until_health(client: httpx.AsyncClient, pred, within: float = 10.0) -> dict:  # type: ignore[no-untyped-def]
    with trio.fail_after(within):
        while True:
            health = (await client.get("/health")).json()
            if pred(health):
                return health
            await trio.sleep(0.01)


def sdk_calls(url: str) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=20)
    out: dict = {"models": [m.id for m in client.models.list()]}
    chat = client.chat.completions.create(model="model", messages=HELLO, max_tokens=6, extra_body={"ignore_eos": True})
    out["chat"] = (chat.choices[0].finish_reason, chat.usage.completion_tokens if chat.usage else None)
    chunks = list(client.chat.completions.create(model="model", messages=HELLO, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    out["stream_finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    out["stream_usage"] = chunks[-1].usage.completion_tokens if chunks[-1].usage else None
    out["stream_chunks"] = len(chunks)
    return out


@pytest.mark.timeout(60)
async def test_openai_sdk_streamed_and_not(server):
    out = await trio.to_thread.run_sync(sdk_calls, server.url)
    assert out["models"] == ["model"]
    assert out["chat"] == ("length", 6)
    assert out["stream_finish"] == "length" and out["stream_usage"] == 6
    assert out["stream_chunks"] >= 3  # role, some text, the finish and usage: streamed, not one body


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_mid_decode_frees_the_slot(server, stream):
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        before = await metrics(client)
        sock = await open_raw(int(server.url.rsplit(":", 1)[1]), CHAT, {
            "messages": HELLO, "max_tokens": 1000, "stream": stream, "ignore_eos": True})
        await until_health(client, lambda h: h["decoding"] == 1)
        if stream:  # events arrive while the request still decodes: the stream is not buffered
            with trio.fail_after(5):
                head = b""
                while b"data: " not in head:
                    head += await sock.recv(1 << 16)
            assert head.startswith(b"HTTP/1.1 200") and (await client.get("/health")).json()["decoding"] == 1
        sock.close()
        await until_health(client, lambda h: h["queued"] == h["prefilling"] == h["decoding"] == 0, within=5)
        after = await metrics(client)
    for name, label in (("trio_mlx_aborts_by_cause_total", {"cause": "disconnect"}),
                        ("trio_mlx_aborts_by_stage_total", {"stage": "decode"})):
        assert after.value(name, **label) == before.value(name, **label) + 1, (name, server.text[-2000:])
    generated = (after.value("trio_mlx_engine_generated_tokens_total")
                 - before.value("trio_mlx_engine_generated_tokens_total"))
    assert generated < 1000  # cut, not run to its end


@pytest.mark.timeout(60)
async def test_a_client_that_stops_reading_is_cut_after_the_stall_timeout(server):
    port = int(server.url.rsplit(":", 1)[1])
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        before = (await metrics(client)).value("trio_mlx_aborts_by_cause_total", cause="stall")
        # Big chunks (8 choices, 20 alternatives per token: ~9 MB in all) and a tiny receive window.
        # Under trio the server's socket holds ~16 KiB unsent (trio sets TCP_NOTSENT_LOWAT); an
        # asyncio server's holds what Linux autotunes it to, up to tcp_wmem's max (4 MiB by
        # default), before its send waits: the stream must outgrow that.
        sock = await open_raw(port, CHAT, {"messages": HELLO, "max_tokens": 950, "n": 8, "stream": True,
                                           "ignore_eos": True, "logprobs": True, "top_logprobs": 20}, rcvbuf=4096)
        t0 = trio.current_time()
        with trio.fail_after(15):
            while (await metrics(client)).value("trio_mlx_aborts_by_cause_total", cause="stall") == before:  # noqa: ASYNC110
                await trio.sleep(0.05)
        waited = trio.current_time() - t0
        await until_health(client, lambda h: h["decoding"] == 0, within=5)
        # The stream was cut: reading what is left ends without its [DONE].
        raw = b""
        with trio.fail_after(20):
            while chunk := await sock.recv(1 << 16):
                raw += chunk
        sock.close()
    assert raw.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in raw
    assert waited < 10, waited


@pytest.mark.timeout(90)
@pytest.mark.skipif(not installed("hypercorn"), reason="hypercorn is not installed")
async def test_an_http2_body_after_its_answer_leaves_hypercorns_trio_worker_serving(tiny_model_fp32):
    """Hypercorn 0.18 raises KeyError for such data, and its trio worker let that end the whole
    server (its asyncio worker logs a traceback and goes on): the app now gates hypercorn's
    connections itself (server/_connections.py), so each ends alone, in one warning line.
    A server of its own: the shared ones' logs must stay free of tracebacks."""
    server = ServerProcess("hypercorn-trio", tiny_model_fp32)
    try:
        port = int(server.url.rsplit(":", 1)[1])
        for _ in range(3):
            await trio.to_thread.run_sync(late_grpc_body, port)
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            assert (await client.get("/health")).status_code == 200
        assert server.proc.poll() is None, server.text[-3000:]
        assert server.text.count("ended by an error inside the HTTP server") == 1, server.text[-3000:]
        assert "Traceback" not in server.text, server.text[-3000:]
    finally:
        server.stop()


async def test_sigterm_lets_an_in_flight_stream_finish(server):
    """Last for each server: it ends the process."""
    events: list = []
    started = trio.Event()
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:

        async def stream() -> None:
            async with client.stream("POST", CHAT, json={"messages": HELLO, "max_tokens": 300, "stream": True,
                                                         "ignore_eos": True}) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                        started.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream)
            with trio.fail_after(10):
                await started.wait()
            server.proc.send_signal(signal.SIGTERM)
    rc = await trio.to_thread.run_sync(server.proc.wait, 30)
    assert events[-1] == "[DONE]", (events[-3:], server.text[-2000:])
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert rc == DRAINED_STATUS[server.kind], (rc, server.text[-3000:])
    assert "Traceback" not in server.text, server.text[-3000:]


def run_to_exit(kind: str, env: dict[str, str], workers: bool = False) -> subprocess.CompletedProcess[str]:
    command, two = SERVERS[kind]
    return subprocess.run([*command, *(two if workers else []), APP], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.timeout(70)
@pytest.mark.parametrize("kind", KINDS)
def test_a_model_that_cannot_load_exits_nonzero(kind, tmp_path):
    proc = run_to_exit(kind, server_env(tmp_path / "no-such-model"))
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "could not start" in proc.stderr and "no such model directory" in proc.stderr, proc.stderr[-3000:]
    print(f"{kind}: exit status {proc.returncode}")


@pytest.mark.timeout(70)
def test_hypercorn_asyncio_alone_in_its_process_exits_nonzero_too(tmp_path):
    """`-w 0`: no supervisor; hypercorn would go on serving, the bridged failure reaching it late."""
    proc = subprocess.run([*SERVERS["hypercorn-asyncio"][0], "-w", "0", APP], env=server_env(tmp_path / "none"),
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and "no such model directory" in proc.stderr, proc.stderr[-3000:]
    assert "Running on" not in proc.stderr, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def own_model(tiny_model_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny model: its serving lock is its own, free of the shared servers'."""
    return Path(shutil.copytree(tiny_model_fp32, tmp_path_factory.mktemp("two-workers") / "model"))


@pytest.mark.timeout(70)
@pytest.mark.parametrize("kind", KINDS)
def test_two_workers_on_one_device_exit_nonzero(kind, own_model):
    proc = run_to_exit(kind, server_env(own_model), workers=True)
    assert proc.returncode != 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if REFUSED in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    holder = int(lines[0].split(REFUSED)[1].split(")")[0])
    deadline = time.monotonic() + 10
    while alive(holder) and time.monotonic() < deadline:  # the worker that got the model stops too
        time.sleep(0.05)
    assert not alive(holder), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    print(f"{kind}: exit status {proc.returncode}")
