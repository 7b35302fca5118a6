"""Helpers for the HTTP tests (tests/test_app_*.py): a real hypercorn on 127.0.0.1:0.

`serve(model, **settings)` runs the app in the test's own trio run with
hypercorn's trio worker and yields a `Server` (its URL and the app, whose
`app.engine` the tests inspect). Leaving the block shuts hypercorn down the
way a signal would: lifespan shutdown, engine drain, actor stopped.
"""

from __future__ import annotations

import logging
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
from trio_mlx._app import TrioMLXApp, create_app
from trio_mlx._settings import Settings

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
        opts = dict(max_batch=settings.max_batch, prefill_batch=settings.prefill_batch,
                    prefill_step=settings.prefill_step, max_queue=settings.max_queue, warmup=False)
        return Engine(settings.model, **{**opts, **engine_options})

    return make


def slow_steps(seconds: float) -> Callable[[str], None]:
    """A fault hook that makes every decode step take at least `seconds` (on the actor thread)."""

    def hook(stage: str) -> None:
        if stage == "step":
            time.sleep(seconds)

    return hook


@asynccontextmanager
async def serve(model: Any, *, factory: Callable[[Settings], Engine] | None = None,
                **settings: Any) -> AsyncIterator[Server]:
    settings.setdefault("warmup", False)
    settings.setdefault("drain_timeout", 2.0)
    app = create_app(Settings(model=str(model), **settings), engine_factory=factory)
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 5.0
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn.trio.serve, app, config, shutdown_trigger=stop.wait))
        try:
            yield Server(app, binds[0], stop)
        finally:
            stop.set()


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
