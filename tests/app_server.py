"""Helpers for the HTTP tests (tests/*/test_app_*.py and others): a real hypercorn on 127.0.0.1:0.

`serve(model, **settings)` runs the app in the test's own trio run with
hypercorn's trio worker and yields a `Server` (its URL and the app, whose
`app.engine` the tests inspect). Leaving the block shuts hypercorn down the
way a signal would: lifespan shutdown, engine drain, actor stopped.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import hypercorn.trio
import trio
from hypercorn.config import Config

from trio_mlx import Engine
from trio_mlx.actor import FakeActor
from trio_mlx.server._app import TrioMLXApp, create_app
from trio_mlx.server._serve import hypercorn_config
from trio_mlx.server._settings import Settings

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello there"}]


@dataclass
class Server:
    app: TrioMLXApp
    url: str
    stop: trio.Event

    @property
    def engine(self) -> Engine:
        assert self.app.engine is not None
        return self.app.engine

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def client(self, **kw: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=kw.pop("timeout", 20.0), **kw)


def engine_factory(**engine_options: Any) -> Callable[[Settings], Engine]:
    """An engine factory with extra Engine options (fault_hook, ...) on top of the settings."""

    def make(settings: Settings) -> Engine:
        # Restarts off unless a test asks: an actor these tests kill breaks the engine.
        opts = dict(max_batch=settings.tuning.max_batch, prefill_batch=settings.tuning.prefill_batch,
                    prefill_step=settings.tuning.prefill_step, max_queue=settings.max_queue, warmup=False,
                    restart_limit=0)
        return Engine(settings.model, **{**opts, **engine_options})

    return make


def fake_factory(**engine_options: Any) -> Callable[[Settings], Engine]:
    """An engine factory over `FakeActor`: the model directory's tokenizer, no weights, no MLX
    work. For the unit layer's HTTP tests, whose answers do not depend on what a model computes
    (error shapes, parameters, headers, probes)."""
    return engine_factory(actor=FakeActor, **engine_options)


def slow_steps(seconds: float) -> Callable[[str], None]:
    """A fault hook that makes every decode step take at least `seconds` (on the actor thread)."""

    def hook(stage: str) -> None:
        if stage == "step":
            time.sleep(seconds)

    return hook


@asynccontextmanager
async def serve(model: Any, *, factory: Callable[[Settings], Engine] | None = None,
                access_log: bool = False, **settings: Any) -> AsyncIterator[Server]:
    """With `access_log`, hypercorn is configured as `trio-mlx serve` configures it."""
    settings.setdefault("warmup", False)
    settings.setdefault("drain_timeout", 2.0)
    # A thread actor, the server's default, whatever TRIO_MLX_ACTOR says (fault hooks need it,
    # and it starts faster). The process actor has its own tests.
    settings.setdefault("actor", "thread")
    app = create_app(Settings.from_env({}, model=str(model), **settings), engine_factory=factory)
    fatal: list[str] = []
    app.on_fatal = fatal.append  # type: ignore[method-assign]  # a broken engine must not end pytest
    app.fatal = fatal  # type: ignore[attr-defined]
    config = hypercorn_config(app.settings) if access_log else Config()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 5.0
    if not access_log:
        config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    stop = trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(hypercorn.trio.serve, app, config, shutdown_trigger=stop.wait))
            try:
                yield Server(app, binds[0], stop)
            finally:
                stop.set()
    finally:
        # A failing test cancels hypercorn before its lifespan shutdown releases the serving
        # lock, and the lock would then refuse every later test's server process for the model.
        if app.serving_lock is not None:
            app.serving_lock.release()


async def until(pred: Callable[[], bool], within: float = 10.0) -> None:
    """Poll `pred` (engine statistics have no events to wait on) for up to `within` seconds."""
    with trio.fail_after(within):
        while not pred():  # noqa: ASYNC110
            await trio.sleep(0.005)


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"messages": HELLO, "max_tokens": 8, **kw}


def assert_error(resp: httpx.Response, status: int, *, code: str | None = None, param: str | None = None,
                 type: str | None = None) -> dict[str, Any]:
    """The response is an OpenAI-shaped error with these fields."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    if type is not None:
        assert err["type"] == type, err
    return err


def raw_request(port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                rcvbuf: int | None = None) -> socket.socket:
    """A blocking socket with one HTTP/1.1 request sent (for clients that misbehave)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    head = {"Host": f"127.0.0.1:{port}", "Content-Length": str(len(body)), **(headers or {})}
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items()), "", ""]
    sock.sendall("\r\n".join(lines).encode() + body)
    return sock


def sse_events(raw: bytes) -> list[bytes]:
    """The events of an SSE body (comments included), checking the framing on the way."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    return raw[:-2].split(b"\n\n")


class Scrape:
    """One /metrics scrape: `scrape.value("trio_mlx_requests_total", endpoint=..., status=...)`."""

    def __init__(self, text: str):
        from prometheus_client.parser import text_string_to_metric_families

        self.text = text
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples.setdefault(s.name, []).append((s.labels, s.value))

    def value(self, name: str, **labels: str) -> float:
        """The sample with exactly these labels (0 when the series does not exist yet)."""
        for have, value in self.samples.get(name, []):
            if have == labels:
                return value
        return 0.0


async def scrape(client: httpx.AsyncClient) -> Scrape:
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4"), r
    return Scrape(r.text)


async def disconnect_mid_decode(engine: Any, port: int, *, stream: bool) -> None:
    """Start a long chat on `port` with a raw socket, close the socket once it decodes, and
    check the engine aborted it in the decode stage within a few steps."""
    before = engine.statistics().aborts_by_stage.get("decode", 0)
    sock = await open_raw(port, CHAT, chat_body(max_tokens=900, stream=stream, ignore_eos=True))
    await until(lambda: engine.statistics().decoding == 1 and engine.statistics().generated_tokens > 0)
    steps = engine.statistics().decode_steps
    sock.close()
    await until(lambda: engine.statistics().active == 0, within=5)
    stats = engine.statistics()
    assert stats.aborts_by_stage["decode"] == before + 1
    assert stats.decode_steps - steps <= 3  # the abort is applied at the next exchange


async def open_raw(port: int, path: str, body: Any = None, *, method: str | None = None,
                   headers: dict[str, str] | None = None, rcvbuf: int | None = None) -> trio.socket.SocketType:
    """A trio socket with one HTTP/1.1 request sent; `body` is JSON-encoded unless it is bytes."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect(("127.0.0.1", port))
    data = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
    head = {"Host": "127.0.0.1", "Content-Length": str(len(data)), **({"Content-Type": "application/json"}
                                                              if body is not None else {}), **(headers or {})}
    lines = [f"{method or ('GET' if body is None else 'POST')} {path} HTTP/1.1",
             *(f"{k}: {v}" for k, v in head.items()), "", ""]
    await sock.send("\r\n".join(lines).encode() + data)
    return sock


def response_complete(raw: bytes) -> bool:
    """A whole HTTP/1.1 response: its Content-Length, or the last chunk of a chunked body."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    if m := re.search(rb"content-length: *(\d+)", head, re.I):
        return len(body) >= int(m.group(1))
    return body.endswith(b"0\r\n\r\n")


async def read_response(sock: trio.socket.SocketType, within: float = 10.0) -> bytes:
    """Read one whole response (or up to EOF) within `within` seconds."""
    out = b""
    with trio.fail_after(within):
        while not response_complete(out):
            chunk = await sock.recv(1 << 16)
            if not chunk:
                break
            out += chunk
    return out


async def until_answer(ask: Callable[[], Any], pred: Callable[[Any], bool], within: float = 5.0) -> Any:
    """Ask (an async call: a GET, a scrape) until `pred` holds of the answer; return that answer."""
    with trio.fail_after(within):
        while True:
            answer = await ask()
            if pred(answer):
                return answer
            await trio.sleep(0.02)
