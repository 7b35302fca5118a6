"""The quart-trio application: the engine's lifecycle, the dispatch, the checks every request
passes, error shapes.

`create_app(settings)` builds it. The engine lives in `app.nursery`: started
in `before_serving` (`TrioMLXApp.start_engine`), drained and closed in `after_serving`
(or earlier, by `app.drain()`, which `trio-mlx serve` calls on SIGTERM). The endpoints are
the route table's (`_routes.py`): the generation endpoints on raw ASGI, which
`TrioMLXApp.serve_trio` hands their requests before Quart sees them, the rest Quart's
routes. Every error body has OpenAI's shape, or, under another API's path, that API's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio
from quart import Response, request
from quart.asgi import ASGIHTTPConnection
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from .._errors import ModelLoadError, TrioMLXError
from ..engine import Engine, ModelPool
from . import _connections, _exit, _intake, _workers
from ._adapters import pick_model
from ._asgi import (
    REQUEST_ID,
    check_api_key,
    cors_headers,
    drain_body,
    log_refusal,
    needs_key,
    request_id,
    send_error,
)
from ._connections import guard_hypercorn_trio
from ._guard import check_framing, check_host
from ._guest import GuestBridge, native_trio
from ._http import HTTPError, new_id, unavailable
from ._logs import request_done
from ._metrics import Metrics
from ._pump import Pump
from ._records import RequestRecord
from ._request_trace import RequestTrace, request_trace_path
from ._routes import GENERATION_PATHS, ROUTES, Route, actor_name, api_under, json_response
from ._settings import Settings
from .openai._serving import Completions

log = logging.getLogger("trio_mlx.http")
_REFUSAL = "trio_mlx.refusal"  # the scope's HTTPError a Quart route answered with, until it is logged

# Seconds hypercorn and quart-trio are given beyond the drain timeout to finish
# writing terminal events and stop the actor. Arbitrary, generous.
SHUTDOWN_MARGIN = 10.0

EngineFactory = Callable[[Settings], Engine]


def default_engine(settings: Settings) -> Engine:
    if settings.distributed:  # rank 0 of a group (engine/_distributed.py)
        from ..engine._distributed import leader_engine

        return leader_engine(settings.distributed, backend=settings.distributed_backend,
                             timeout=settings.distributed_timeout, startup_timeout=settings.startup_timeout,
                             **_engine_options(settings))
    return Engine(**_engine_options(settings))


def _engine_options(settings: Settings) -> dict[str, Any]:
    """The engine's keywords from the settings: the actor's tuning whole, and the engine's own."""
    return dict(
        model=settings.model,
        tuning=settings.tuning,
        max_queue=settings.max_queue,
        cache_dir=settings.cache_dir,  # type: ignore[arg-type]
        actor=settings.actor,
        sampling_defaults=None if settings.generation_config == "auto" else {},
        restart_limit=settings.restart_limit,
        restart_window=settings.restart_window,
        restart_backoff=settings.restart_backoff,
        default_max_tokens=settings.default_max_tokens,
    )


class _HTTPConnection(TrioASGIHTTPConnection):
    """quart-trio's HTTP connection, minus a race that leaks keep-alive connections.

    Hypercorn reports `http.disconnect` to the app while it finishes the final
    send (it recycles the connection for keep-alive inside that send). quart-trio
    then cancels the request, cutting hypercorn's recycling short: the
    connection never gets its keep-alive timeout and stays open until the
    client closes it (or, at shutdown, until the graceful timeout). So: a
    disconnect that arrives once the final body message is being sent is the
    end of the exchange, not a reason to cancel.
    """

    _finishing = False

    async def handle_messages(self, nursery: trio.Nursery, request: Any, receive: Any) -> None:  # type: ignore[override]
        await ASGIHTTPConnection.handle_messages(self, request, receive)
        if not self._finishing:
            nursery.cancel_scope.cancel()

    async def _send_response(self, send: Any, response: Any) -> None:
        async def tracked(message: Any) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self._finishing = True
            await send(message)

        await super()._send_response(tracked, response)


class TrioMLXApp(QuartTrio):
    """A QuartTrio app that owns one Engine and serves the route table (`_routes.py`)."""

    asgi_http_class = _HTTPConnection

    settings: Settings
    engine: Engine | None
    pool: ModelPool | None  # with --models (`engine/_pool.py`); `engine` is None then
    # The actors the pool's GPU thread runs, `make(config, link)` (tests: a `FakeActor`); None: `Actor`.
    pool_actor: Callable[..., Any] | None = None
    make_engine: EngineFactory
    pump: Pump
    completions: Completions
    # The routes served on raw ASGI, by path (the rest are Quart's): `mount` fills both.
    asgi_routes: dict[str, Route]
    metrics: Metrics
    serving_lock: _workers.ServingLock | None
    request_trace: RequestTrace | None  # with the step trace (`_request_trace.py`)
    # Called with every completion request's record when it ends (sync, must be quick).
    observers: list[Callable[[RequestRecord], None]]
    started_at: int  # the model cards' `created`
    openapi_doc: dict[str, Any] | None  # built by the first request for it (`_routes.openapi`)
    # Around the tasks that watch the serving engine (stalls, the heap's trim, a broken engine).
    watchdog: trio.CancelScope

    # How the app is served, fixed by the first ASGI call (the lifespan): natively on trio
    # (hypercorn -k trio, trio-mlx serve) or, under an asyncio server, through trio's guest mode.
    _serve: Callable[[Any, Any, Any], Awaitable[None]] | None = None
    # The ASGI server, read off the lifespan: a failed startup must stop it non-zero (_exit.py).
    asgi_server: _exit.ServerInfo = _exit.ServerInfo()
    # Why the engine could not start, once it could not (logged in one line by start_engine).
    start_failure: BaseException | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        serve = self._serve
        if serve is None:
            if native_trio():
                guard_hypercorn_trio()  # hypercorn -k trio: one connection's failure stays its own
                serve = self._serve = self.serve_trio
            else:
                serve = self._serve = GuestBridge(self.serve_trio)
        if scope["type"] == "lifespan":
            self.asgi_server = _exit.ServerInfo.of(receive)
        await serve(scope, receive, send)

    async def serve_trio(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI app proper, on trio (the guest run's, under an asyncio server)."""
        if scope["type"] == "http":
            try:
                try:
                    check_host(scope, self.settings.allowed_hosts)  # DNS rebinding (_guard.py)
                    check_framing(scope)
                except HTTPError as error:
                    if error.code == "invalid_framing":  # its answer closes the connection
                        await drain_body(receive)
                    api = api_under(scope["path"])
                    await send_error(send, error, [], api.error_body if api is not None else None)
                    return
                if (route := self.asgi_routes.get(scope["path"])) is not None:
                    await route.handler(self, scope, receive, send)
                else:
                    await self.asgi_app(scope, receive, send)
            finally:
                request_done(scope)  # the access log's held line, if any (_logs.py)
            return
        await self.asgi_app(scope, receive, send)

    async def start_engine(self) -> None:
        """Lifespan startup: take the serving lock, start the engine, watch it, log what serves."""
        settings = self.settings
        _connections.raise_soft_limit()  # every connection is a descriptor (_connections.py)
        _connections.quiet_accept_errors()
        _intake.return_large_allocations()
        try:
            if not settings.allow_multiple_workers:
                self.serving_lock = _workers.acquire(settings)
            if settings.models:
                await self.start_pool()
                return
            engine = self.engine = self.make_engine(settings)
            await self.nursery.start(engine.run)
            if settings.tuning.step_trace:
                self.request_trace = RequestTrace(request_trace_path(settings.tuning.step_trace))
                self.observers.append(self.request_trace.observe)
        except BaseException as exc:
            self.release_lock()
            self.start_failure = exc
            if isinstance(exc, Exception):  # where the server would not exit non-zero, exit (_exit.py)
                holder = (exc.holder, exc.holder_parent) if isinstance(exc, _workers.AlreadyServing) else None
                _exit.exit_if_unseen(
                    self.asgi_server, str(exc) if holder else f"trio_mlx could not start: {exc}",
                    lock_holder=holder, others_may_serve=settings.allow_multiple_workers)
            log.error("trio_mlx could not start: %s", exc)
            raise
        self.nursery.start_soon(_run_in(self.watchdog, self.pump.watch_stalls, _intake.trimmer,
                                        partial(_exit_when_broken, self, engine)))
        info = engine.info
        cache = info.prompt_cache_bytes if info else 0
        log.info("ready: serving %r (%s, context %s tokens, max batch %d) on %s%s, %s actor (pid %s), %s",
                 settings.served_model_name, info.model_type if info else "?",
                 engine.context_length, settings.tuning.max_batch, info.device if info else "?",
                 f" with {info.blas}" if info and info.blas else "", actor_name(engine),
                 info.pid if info else "?",
                 f"prompt cache up to {cache / 1e9:.2f} GB" if cache else "prompt cache off")
        log.info("sampling defaults (generation_config %s): %s", settings.generation_config,
                 ", ".join(f"{k}={v}" for k, v in engine.sampling_defaults.items()) or "none")
        if engine.group is not None:
            log.info("distributed: %s", engine.group.describe())

    async def start_pool(self) -> None:
        """With `--models`: start the GPU thread; each model loads when a request names it."""
        settings = self.settings
        options = _engine_options(settings)
        options.pop("model")
        pool = self.pool = ModelPool(settings.model_table, max_loaded=settings.max_loaded_models,
                                     max_bytes=int(settings.max_loaded_gb * 1e9),
                                     load_timeout=settings.startup_timeout, engine_options=options,
                                     model_options={name: {"tuning": settings.model_tuning(name)}
                                                    for name in settings.model_adapter_map},
                                     make_actor=self.pool_actor)
        await self.nursery.start(pool.run)
        self.nursery.start_soon(_run_in(self.watchdog, self.pump.watch_stalls, _intake.trimmer))
        log.info("ready: serving %d models, each loaded on first use, at most %d at once%s: %s",
                 len(pool.names), pool.max_loaded,
                 f" and {settings.max_loaded_gb:g} GB of weights" if pool.max_bytes else "", ", ".join(pool.names))

    async def stop_engine(self) -> None:
        """Lifespan shutdown: drain, stop watching, let go of the lock and the request trace."""
        try:
            await self.drain()
        finally:
            self.watchdog.cancel()
            self.release_lock()
            if self.request_trace is not None:
                self.request_trace.close()

    def release_lock(self) -> None:
        if self.serving_lock is not None:
            self.serving_lock.release()
            self.serving_lock = None

    def log_exception(self, exc_info: Any) -> None:
        if isinstance(exc_info[1], ModelLoadError) or (
                exc_info[1] is self.start_failure and isinstance(exc_info[1], TrioMLXError)):
            return  # start_engine logged it in one line (a model that fails to load, the serving
            # lock held); its traceback says nothing more
        super().log_exception(exc_info)

    def on_fatal(self, reason: str) -> None:
        """The server cannot serve on (the engine is broken): end the process, non-zero.
        `trio-mlx serve` replaces this with a drain and exit 1 (`_serve.py`); under another
        ASGI server the process exits 1 a second from now (the requests in flight have
        already ended), and hypercorn's supervisor, which would exit 0, is stopped (`_exit.py`)."""
        log.critical("%s; exiting", reason)

        async def bye() -> None:
            await trio.sleep(1.0)
            logging.shutdown()
            _exit.exit_failed(self.asgi_server, reason)

        self.nursery.start_soon(bye)

    @asynccontextmanager
    async def engine_for(self, model: str | None) -> AsyncIterator[Engine]:
        """The engine that serves a request naming `model` (checked by `pick_adapter`): the one
        engine, or with `--models` that model's, loaded first if need be (the request waits for
        the load; `ModelCapacityError` when no idle model can make room). Enter the request's
        stream inside the block: until then the model is not unloaded."""
        if self.pool is None:
            yield self.ready_engine()
            return
        async with self.pool.use(pick_model(self.settings, model)) as engine:
            yield engine

    def ready_engine(self) -> Engine:
        """The engine, for admitting a request; 503 while there is none yet."""
        if self.engine is None:
            raise unavailable("the model is still loading; retry shortly")
        return self.engine

    def open_streams(self) -> int:
        """Streamed responses being written now."""
        return len(self.pump.streams)

    def observe(self, record: RequestRecord) -> None:
        for observer in self.observers:
            try:
                observer(record)
            except Exception:
                log.exception("request observer %r failed", observer)

    async def drain(self) -> None:
        """Stop admitting (new requests and readiness get 503), let in-flight requests run for
        up to drain_timeout seconds, end the rest with a terminal event, stop the actor."""
        if self.pool is not None:
            await self.pool.aclose(drain_timeout=self.settings.drain_timeout)
            return
        engine = self.engine
        if engine is None:
            return
        if engine.state == "ready":
            stats = engine.statistics()
            log.info("draining: %d request(s) in flight, up to %.1f s",
                     stats.queued + stats.prefilling + stats.decoding, self.settings.drain_timeout)
        await engine.aclose(drain_timeout=self.settings.drain_timeout)


def create_app(settings: Settings | None = None, *, engine_factory: EngineFactory | None = None) -> TrioMLXApp:
    """Build the server. `settings` default to the TRIO_MLX_* environment; nothing is loaded
    until the app is served (the model loads in the lifespan startup)."""
    settings = Settings.from_env() if settings is None else settings
    app = TrioMLXApp("trio_mlx", static_folder=None)  # _pages.py serves /static itself
    app.settings = settings
    app.engine = None
    app.pool = None
    app.make_engine = engine_factory or default_engine
    app.observers = []
    app.pump = Pump(app)
    app.completions = Completions(app, app.pump)
    app.metrics = Metrics(app, GENERATION_PATHS)
    app.observers.append(app.metrics.observe)
    app.serving_lock = None
    app.request_trace = None
    app.started_at = int(time.time())
    app.openapi_doc = None
    app.watchdog = trio.CancelScope()
    app.config.update(
        MAX_CONTENT_LENGTH=settings.max_body_bytes,
        BODY_TIMEOUT=settings.body_timeout,
        BACKGROUND_TASK_SHUTDOWN_TIMEOUT=settings.drain_timeout + SHUTDOWN_MARGIN,
        PROVIDE_AUTOMATIC_OPTIONS=True,
    )
    app.before_serving(app.start_engine)
    app.after_serving(app.stop_engine)
    app.before_request(partial(authenticate, app))
    app.after_request(partial(add_headers, app))
    app.register_error_handler(HTTPError, partial(api_error, app))
    app.register_error_handler(HTTPException, partial(http_exception, app))
    app.register_error_handler(Exception, partial(internal_error, app))
    mount(app, ROUTES)
    return app


def mount(app: TrioMLXApp, routes: Sequence[Route]) -> None:
    """The dispatch, from the route table: the raw routes by path (`serve_trio`), the rest
    as Quart's routes (each named by its path), their handlers given the app."""
    app.asgi_routes = {}
    for route in routes:
        if route.asgi:
            app.asgi_routes[route.path] = route
        else:
            app.add_url_rule(route.path, endpoint=route.path, view_func=partial(route.handler, app),
                             methods=route.methods)


# ------------------------------------------------------- what every Quart route's request passes


async def authenticate(app: TrioMLXApp) -> None:
    if request.method != "OPTIONS" and needs_key(request.path):
        check_api_key(request.headers.get("Authorization"), app.settings.api_key)


async def add_headers(app: TrioMLXApp, response: Response) -> Response:
    """CORS and X-Request-Id on every Quart answer; its refusal logged; its route counted."""
    origin = request.headers.get("Origin")
    for key, value in cors_headers(origin, app.settings.cors_origins, preflight=request.method == "OPTIONS",
                                   requested=request.headers.get("Access-Control-Request-Headers")):
        response.headers[key.decode()] = value.decode()
    scope: dict[str, Any] = request.scope  # type: ignore[assignment]
    rid = scope[REQUEST_ID] = request_id(scope, new_id("req-"))
    response.headers["X-Request-Id"] = rid
    if (refusal := scope.pop(_REFUSAL, None)) is not None:
        log_refusal(refusal, rid)
    rule = request.url_rule
    app.metrics.observe_route(rule.rule if rule is not None else "unmatched", response.status_code)
    return response


def error_response(error: HTTPError, headers: dict[str, str]) -> Response:
    """`error` in the shape of the API whose path was asked for (`_routes.api_under`)."""
    scope: dict[str, Any] = request.scope  # type: ignore[assignment]
    scope[_REFUSAL] = error  # logged with its request id (add_headers)
    api = api_under(request.path)
    if api is None:
        return json_response(error.payload(), error.status, headers)
    return Response(api.error_body(error), status=error.status, headers=headers, content_type="application/json")


async def api_error(app: TrioMLXApp, error: HTTPError) -> Response:
    return error_response(error, dict(error.headers))


async def http_exception(app: TrioMLXApp, exc: HTTPException) -> Response:
    """Werkzeug's errors (no route, a method it lacks, a body too large) as ours."""
    status = exc.code or 500
    headers: dict[str, str] = {}
    if status == 404:
        error = HTTPError(404, f"Invalid URL ({request.method} {request.path})", code="not_found")
    elif status == 405:
        allowed = ", ".join(getattr(exc, "valid_methods", None) or ())
        headers["Allow"] = allowed
        error = HTTPError(405, f"method {request.method} is not allowed on {request.path}",
                          code="method_not_allowed")
    elif status == 413:
        error = HTTPError(413, f"the request body is larger than {app.settings.max_body_bytes} bytes",
                          code="request_too_large")
    elif status >= 500:
        error = HTTPError(status, "internal server error", type="server_error", code="internal_error")
    else:
        error = HTTPError(status, exc.description or exc.name, code=exc.name.lower().replace(" ", "_"))
    return error_response(error, headers)


async def internal_error(app: TrioMLXApp, exc: Exception) -> Response:
    log.exception("internal error on %s %s", request.method, request.path)
    error = HTTPError(500, "internal server error", type="server_error", code="internal_error")
    return json_response(error.payload(), 500)


async def _exit_when_broken(app: TrioMLXApp, engine: Engine) -> None:
    """An engine past its restart budget serves nothing more: stop the server, non-zero, so
    that the process supervisor (systemd, Kubernetes) takes over (engine/_supervise.py)."""
    await engine.wait_broken()
    budget = engine.restart_budget
    app.on_fatal(f"the GPU actor died and was not restarted (restart limit {budget.limit} "
                 f"within {budget.window:g} s): {engine.actor_error!r}")


def _run_in(scope: trio.CancelScope, *fns: Callable[[], Any]) -> Callable[[], Any]:
    async def run() -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                for fn in fns:
                    nursery.start_soon(fn)

    return run
