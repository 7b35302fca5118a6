"""The guest-mode bridge (`trio_mlx/_guest.py`): a trio ASGI app on an asyncio server's loop.

The bridge alone, on plain asyncio (no server, no model): backpressure, both
directions of cancellation, disconnects, the lifespan. Then the real app under
hypercorn's asyncio worker and uvicorn, in this process (a thread of its own
runs the server's loop), to count decode steps: a disconnect aborts its
request at the next exchange, as under `-k trio` (tests/integration/test_app_cancel.py).

Here the bridge alone; the real app: tests/integration/test_guest.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import trio

from trio_mlx.server._guest import GuestBridge, ServerGone


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
