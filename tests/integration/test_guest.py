"""The guest-mode bridge (`trio_mlx/_guest.py`): a trio ASGI app on an asyncio server's loop.

The bridge alone, on plain asyncio (no server, no model): backpressure, both
directions of cancellation, disconnects, the lifespan. Then the real app under
hypercorn's asyncio worker and uvicorn, in this process (a thread of its own
runs the server's loop), to count decode steps: a disconnect aborts its
request at the next exchange, as under `-k trio` (tests/integration/test_app_cancel.py).

Here the real app; the bridge alone: tests/unit/test_guest.py.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from app_server import disconnect_mid_decode, engine_factory, slow_steps

from trio_mlx.server._app import TrioMLXApp, create_app
from trio_mlx.server._guest import GuestBridge
from trio_mlx.server._settings import Settings

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
    settings = Settings.from_env({}, model=str(tiny_model_fp32), warmup=False, drain_timeout=2.0, actor="thread")
    app = create_app(settings, engine_factory=engine_factory(fault_hook=slow_steps(0.005)))
    with asyncio_server(app, kind) as port:
        engine = app.engine
        assert engine is not None and isinstance(app._serve, GuestBridge)  # served through the bridge
        for stream in (True, False):
            await disconnect_mid_decode(engine, port, stream=stream)
