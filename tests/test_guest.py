"""The guest-mode bridge (`trio_mlx/_guest.py`): a trio ASGI app on an asyncio server's loop.

The bridge alone, on plain asyncio (no server, no model): backpressure, both
directions of cancellation, disconnects, the lifespan. Then the real app under
hypercorn's asyncio worker and uvicorn, in this process (a thread of its own
runs the server's loop), to count decode steps: a disconnect aborts its
request at the next exchange, as under `-k trio` (test_app_cancel.py).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import trio
from app_server import CHAT, chat_body, engine_factory, open_raw, slow_steps, until

from trio_mlx.server._app import TrioMLXApp, create_app
from trio_mlx.server._guest import GuestBridge, ServerGone
from trio_mlx.server._settings import Settings


def run_bridged(app: Any, scope: dict, receive: Any, send: Any, host: Callable[..., Any] | None = None) -> Any:
    """Call `app` through a GuestBridge on a fresh asyncio loop, inside a lifespan that starts and
    ends the trio run; `host(call)` (optional) drives the call from the asyncio side."""

    async def lifespan_app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            assert (await receive())["type"] == "lifespan.startup"
            await send({"type": "lifespan.startup.complete"})
            assert (await receive())["type"] == "lifespan.shutdown"
            await send({"type": "lifespan.shutdown.complete"})
        else:
            await app(scope, receive, send)

    async def main() -> Any:
        bridge = GuestBridge(lifespan_app)
        life: asyncio.Queue[dict] = asyncio.Queue()
        sent: list[str] = []
        started = asyncio.Event()

        async def life_send(message: dict) -> None:
            sent.append(message["type"])
            started.set()

        await life.put({"type": "lifespan.startup"})
        lifespan = asyncio.ensure_future(bridge({"type": "lifespan"}, life.get, life_send))
        await started.wait()
        call = bridge(scope, receive, send)
        result = await (host(call) if host else call)
        await life.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(lifespan, 5)
        assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
        return result

    return asyncio.run(main())


@pytest.mark.timeout(10)
def test_a_trio_send_returns_only_when_the_servers_send_has():
    """Backpressure: a server send that waits (a client not reading) holds the trio sender."""
    log: list[str] = []
    gate: dict[str, asyncio.Event] = {}

    async def host_send(message: dict) -> None:
        log.append("host send starts")
        await gate["open"].wait()
        log.append("host send returns")

    async def app(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        log.append("trio send returned")

    async def host(call: Any) -> None:
        gate["open"] = asyncio.Event()
        task = asyncio.ensure_future(call)
        await asyncio.sleep(0.2)
        assert log == ["host send starts"]  # the trio side still waits
        gate["open"].set()
        await task

    run_bridged(app, {"type": "http"}, None, host_send, host)
    assert log == ["host send starts", "host send returns", "trio send returned"]


@pytest.mark.timeout(10)
def test_a_trio_cancel_cancels_the_servers_pending_call():
    """A cancelled trio receive (the request is over) cancels the server's receive on the host."""
    log: list[str] = []

    async def host_receive() -> dict:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            log.append("host receive cancelled")
            raise
        return {}

    async def app(scope: dict, receive: Any, send: Any) -> None:
        with trio.move_on_after(0.1):
            await receive()
        log.append("trio receive cancelled")
        await trio.sleep(0.05)  # the host's cancellation runs meanwhile

    run_bridged(app, {"type": "http"}, host_receive, None)
    assert sorted(log) == ["host receive cancelled", "trio receive cancelled"]


@pytest.mark.timeout(10)
def test_the_server_cancelling_a_call_ends_the_trio_task_first():
    """The server's graceful timeout: the trio task is cancelled and has finished before the
    server's call raises CancelledError."""
    log: list[str] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        try:
            await trio.sleep(30)
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(0.1)  # cleanup that takes a while
            log.append("trio task finished")

    async def host(call: Any) -> None:
        task = asyncio.ensure_future(call)
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        log.append("server call cancelled")

    run_bridged(app, {"type": "http"}, None, None, host)
    assert log == ["trio task finished", "server call cancelled"]


@pytest.mark.timeout(10)
def test_a_disconnect_reaches_the_trio_handler_and_errors_reach_the_server():
    got: list[dict] = []

    async def host_receive() -> dict:
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    async def app(scope: dict, receive: Any, send: Any) -> None:
        got.append(await receive())
        raise ValueError("the app's own error")

    with pytest.raises(ValueError, match="the app's own error"):
        run_bridged(app, {"type": "http"}, host_receive, None)
    assert got == [{"type": "http.disconnect"}]


@pytest.mark.timeout(10)
def test_a_call_the_server_cancels_on_its_side_is_server_gone_in_trio():
    seen: list[type] = []

    async def host_send(message: dict) -> None:
        asyncio.current_task().cancel()  # type: ignore[union-attr]
        await asyncio.sleep(1)

    async def app(scope: dict, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        except ServerGone as exc:
            seen.append(type(exc))

    run_bridged(app, {"type": "http"}, None, host_send)
    assert seen == [ServerGone]


# -- the app under asyncio servers, in this process ------------------------------------------


@contextmanager
def asyncio_server(app: TrioMLXApp, kind: str) -> Iterator[int]:
    """Serve `app` with hypercorn's asyncio worker or uvicorn on a thread's own loop; yield the port."""
    port: list[int] = []
    ready, stop = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    async def serve() -> None:
        async def stopped() -> None:
            while not stop.is_set():  # noqa: ASYNC110 - a threading.Event, set by the test's thread
                await asyncio.sleep(0.02)

        if kind == "hypercorn":
            import hypercorn.asyncio
            from hypercorn.config import Config

            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            port.append(sock.getsockname()[1])
            # Listening before hypercorn takes the socket: hypercorn starts its server only after
            # the lifespan startup that makes the engine ready, so a connect in between was refused.
            sock.listen()
            config = Config()
            config.bind = [f"fd://{sock.detach()}"]  # hypercorn's from here on
            config.graceful_timeout = 5.0
            config.accesslog = None
            task = asyncio.ensure_future(hypercorn.asyncio.serve(app, config, shutdown_trigger=stopped))
            while app.engine is None or app.engine.state != "ready":  # noqa: ASYNC110 - trio's state
                await asyncio.sleep(0.01)
            ready.set()
            await task
        else:
            import uvicorn

            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                   access_log=False))
            task = asyncio.ensure_future(server.serve())
            while not server.started:  # noqa: ASYNC110 - uvicorn has no event for it
                await asyncio.sleep(0.01)
            port.append(server.servers[0].sockets[0].getsockname()[1])
            ready.set()
            await stopped()
            server.should_exit = True
            await task

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            failure.append(exc)
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(60)
    if failure:
        raise failure[0]
    try:
        yield port[0]
    finally:
        stop.set()
        thread.join(30)
        assert not thread.is_alive()
        if failure:
            raise failure[0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["hypercorn", "uvicorn"])
async def test_disconnect_mid_decode_frees_the_slot_within_a_step(tiny_model_fp32, kind):
    settings = Settings(model=str(tiny_model_fp32), warmup=False, drain_timeout=2.0, actor="thread")
    app = create_app(settings, engine_factory=engine_factory(fault_hook=slow_steps(0.005)))
    with asyncio_server(app, kind) as port:
        engine = app.engine
        assert engine is not None and isinstance(app._serve, GuestBridge)  # served through the bridge
        for stream in (True, False):
            before = engine.statistics().aborts_by_stage.get("decode", 0)
            sock = await open_raw(port, CHAT, chat_body(max_tokens=900, stream=stream, ignore_eos=True))
            await until(lambda: engine.statistics().decoding == 1 and engine.statistics().generated_tokens > 0)
            steps = engine.statistics().decode_steps
            sock.close()
            await until(lambda: engine.statistics().active == 0, within=5)
            stats = engine.statistics()
            assert stats.aborts_by_stage["decode"] == before + 1
            assert stats.decode_steps - steps <= 3  # the abort is applied at the next exchange
