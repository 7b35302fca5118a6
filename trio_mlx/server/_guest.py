"""Serve the trio application from an asyncio ASGI server: trio in guest mode on the server's loop.

`trio_mlx.app:app` is a trio program (quart-trio, the engine's nursery, memory
channels, cancel scopes). Under hypercorn's trio worker it runs natively. Under
a server that runs asyncio (hypercorn's default worker, uvicorn, granian),
`GuestBridge` runs it in trio's guest mode (`trio.lowlevel.start_guest_run`) on
that server's own event loop: same thread, same process, one trio run for the
server's life. The lifespan call starts the run and lasts as long as it; each
request is a task of that run; its `receive` and `send` are the server's own,
run on the host loop and awaited from trio:

- receive: the server's `http.disconnect` reaches the trio handler as it does
  natively, so a client that goes away aborts its request at the next step;
- send: the trio side resumes only when the server's send has returned, so the
  server's backpressure (a client that stops reading) holds the trio sender and
  the stall watchdog sees it; nothing is buffered on the way;
- cancellation, both ways: a trio cancel cancels the host's pending call (as an
  asyncio app's cancel would); the server cancelling a call (its graceful
  timeout) cancels the trio task and waits until it has finished.

Why not a library: trio-asyncio and aioguest run the other way round (asyncio
inside trio, or asyncio as the guest of another loop), anyio runs on one loop
or the other, and asgiref-trio was last released in 2020. What is left is this
module. Trio's guest mode runs trio's I/O wait on a helper thread and every trio
step on the host's thread, so both sides call each other's synchronous API
(`reschedule`, `start_soon`, `CancelScope.cancel`, `Future.set_result`) directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import outcome
import sniffio
import trio

from .._errors import TrioMLXError

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]
_LIFESPAN_ENDS = ("lifespan.startup.failed", "lifespan.shutdown.complete", "lifespan.shutdown.failed")


def native_trio() -> bool:
    """Whether the server calling the app runs trio (hypercorn -k trio, trio-mlx serve)."""
    return sniffio.current_async_library() == "trio"


class ServerGone(TrioMLXError):
    """The server cancelled a receive or send it was running for the trio side: it is stopping."""


class GuestBridge:
    """An asyncio ASGI app that runs the trio ASGI app `app` in a guest run on the caller's loop."""

    def __init__(self, app: ASGIApp):
        self._app = app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: asyncio.Future[None] | None = None
        self._finished: asyncio.Future[outcome.Outcome[None]] | None = None
        self._nursery: trio.Nursery | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        await self._start()
        if scope["type"] != "lifespan":
            await self._call(scope, receive, send)
            return
        # The lifespan call lasts from startup to shutdown, and so does the trio run. Once the
        # app has reported the lifespan's end, servers cancel the call (hypercorn at once, the
        # others when their loop closes), expecting it to be over: a native app returns in the
        # same step as its last send, the trio side a few loop turns later. So that cancel
        # only hurries the end; it is not the server's to see again.
        ended = False

        async def lifespan_send(message: Any) -> None:
            nonlocal ended
            ended = ended or message["type"] in _LIFESPAN_ENDS
            await send(message)

        try:
            await self._call(scope, receive, lifespan_send)
        except asyncio.CancelledError:
            if not ended:
                raise
        finally:
            await self._stop()

    # -- the trio run --------------------------------------------------------------------

    async def _start(self) -> None:
        if self._started is None:
            loop = self._loop = asyncio.get_running_loop()
            self._started, self._finished = loop.create_future(), loop.create_future()
            trio.lowlevel.start_guest_run(
                self._main,
                run_sync_soon_threadsafe=loop.call_soon_threadsafe,
                run_sync_soon_not_threadsafe=loop.call_soon,
                done_callback=self._done,
                # The server owns the process's signals (asyncio's add_signal_handler sets the
                # wakeup fd; uvicorn and hypercorn's supervisor install their own handlers).
                host_uses_signal_set_wakeup_fd=True,
            )
        await asyncio.shield(self._started)

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            assert self._started is not None
            self._started.set_result(None)
            await trio.sleep_forever()

    def _done(self, result: outcome.Outcome[None]) -> None:
        assert self._started is not None and self._finished is not None
        if not self._started.done():
            self._started.set_exception(RuntimeError("the trio run ended before it started"))
        if not self._finished.done():
            self._finished.set_result(result)

    async def _stop(self) -> None:
        """End the trio run (its last requests, if the server left any, are cancelled)."""
        assert self._nursery is not None and self._finished is not None
        self._nursery.cancel_scope.cancel()
        await _until_done(self._finished)
        result = self._finished.result()
        self._started = self._finished = self._nursery = None  # a later lifespan starts a new run
        result.unwrap()

    # -- one ASGI call -------------------------------------------------------------------

    async def _call(self, scope: Scope, receive: Any, send: Any) -> None:
        assert self._loop is not None and self._nursery is not None
        done: asyncio.Future[outcome.Outcome[None]] = self._loop.create_future()
        cancel = trio.CancelScope()
        self._nursery.start_soon(self._run, scope, receive, send, cancel, done)
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            # The server gave up on this call (its graceful timeout, a shutdown): the trio
            # task ends first, as a cancelled asyncio app would before returning.
            cancel.cancel()
            await _until_done(done)
            raise
        done.result().unwrap()

    async def _run(self, scope: Scope, receive: Any, send: Any, cancel: trio.CancelScope,
                   done: asyncio.Future[outcome.Outcome[None]]) -> None:
        on_host = self._on_host

        async def trio_receive() -> Any:
            return await on_host(receive())

        async def trio_send(message: Any) -> None:
            await on_host(send(message))

        result: outcome.Outcome[None] = outcome.Value(None)
        try:
            with cancel:
                await self._app(scope, trio_receive, trio_send)
        except BaseException as exc:
            if not _only_cancelled(exc):
                result = outcome.Error(exc)  # the server's to report, as for any app's error
            else:
                raise  # the run is stopping: the call was cut, and its server side ends quietly
        finally:
            if not done.done():
                done.set_result(result)

    async def _on_host(self, awaitable: Any) -> Any:
        """Run one of the server's receive or send calls on the host loop; wait for it here."""
        future = asyncio.ensure_future(awaitable, loop=self._loop)  # granian's are not coroutines
        task = trio.lowlevel.current_task()

        def wake(f: asyncio.Future[Any]) -> None:
            if f.cancelled():
                trio.lowlevel.reschedule(task, outcome.Error(ServerGone("the server cancelled this call")))
            else:
                trio.lowlevel.reschedule(task, outcome.capture(f.result))

        def abort(_: Any) -> trio.lowlevel.Abort:
            if future.done():
                # Its result is already on its way (`wake` is scheduled): take it, and let the
                # cancellation land at the next checkpoint, so that no message is lost.
                return trio.lowlevel.Abort.FAILED
            future.remove_done_callback(wake)
            future.cancel()
            return trio.lowlevel.Abort.SUCCEEDED

        future.add_done_callback(wake)
        return await trio.lowlevel.wait_task_rescheduled(abort)


def _only_cancelled(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_cancelled(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled)


async def _until_done(future: asyncio.Future[Any]) -> None:
    """Wait for `future` even through cancellation: what it waits for must finish first."""
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.done():
                continue
