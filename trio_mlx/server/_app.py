"""The quart-trio application: the engine's lifecycle, probes, /v1/models, OpenAPI, error shapes.

`create_app(settings)` builds it. The engine lives in `app.nursery`: started
in `before_serving`, drained and closed in `after_serving` (or earlier, by
`app.drain()`, which `trio-mlx serve` calls on SIGTERM). The completion
endpoints are raw ASGI (`_pump.py`, `openai/_serving.py`): `TrioMLXApp.__call__` routes them
before Quart sees the request. Every error body has OpenAI's shape.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio
from quart import Response, request
from quart.asgi import ASGIHTTPConnection
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from .._errors import ModelLoadError, TrioMLXError
from ..engine import Engine
from . import _connections, _exit, _intake, _workers
from ._asgi import (
    REQUEST_ID,
    check_api_key,
    cors_headers,
    drain_body,
    log_refusal,
    request_id,
    send_error,
)
from ._guard import check_framing, check_host
from ._guest import GuestBridge, native_trio
from ._http import HTTPError, dumps, new_id, unavailable
from ._logs import request_done
from ._metrics import Metrics
from ._pages import add_pages
from ._pump import Pump
from ._records import CHAT_PATH, COMPLETIONS_PATH, RequestRecord
from ._request_trace import RequestTrace, request_trace_path
from ._settings import Settings
from ._wire import WireAPI, serve_api
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


def _openapi_document(settings: Settings) -> dict[str, Any]:
    """The OpenAPI document (`_openapi.py`, imported only when asked for)."""
    from . import _openapi

    return _openapi.openapi_document(settings)


def _actor_name(engine: Engine) -> str:
    return engine.actor_mode if isinstance(engine.actor_mode, str) else "thread"


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
    """A QuartTrio app that owns one Engine and serves the completion endpoints on raw ASGI."""

    asgi_http_class = _HTTPConnection

    settings: Settings
    engine: Engine | None
    pump: Pump
    completions: Completions
    # The other APIs' endpoints on the same machinery (_wire.py), by path.
    wire_apis: dict[str, WireAPI]
    metrics: Metrics
    serving_lock: _workers.ServingLock | None
    request_trace: RequestTrace | None  # with the step trace (`_request_trace.py`)
    # Called with every completion request's record when it ends (sync, must be quick).
    observers: list[Callable[[RequestRecord], None]]

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
            serve = self._serve = self.serve_trio if native_trio() else GuestBridge(self.serve_trio)
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
                    api = self.wire_api_under(scope["path"])
                    await send_error(send, error, [], api.error_body if api is not None else None)
                    return
                if scope["path"] in (CHAT_PATH, COMPLETIONS_PATH):
                    await self.completions(scope, receive, send)
                elif (api := self.wire_apis.get(scope["path"])) is not None:
                    await serve_api(self.pump, api, scope, receive, send)
                else:
                    await self.asgi_app(scope, receive, send)
            finally:
                request_done(scope)  # the access log's held line, if any (_logs.py)
            return
        await self.asgi_app(scope, receive, send)

    def wire_api_under(self, path: str) -> WireAPI | None:
        """The other API whose path `path` is, or lies under: its errors take that API's shape
        (an Anthropic SDK reads only Anthropic's errors, `/v1/messages/batches` included)."""
        return next((a for p, a in self.wire_apis.items() if path == p or path.startswith(p + "/")), None)

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
    app.observers = []
    app.pump = Pump(app)
    app.completions = Completions(app, app.pump)
    app.wire_apis = wire_apis()
    app.metrics = Metrics(app)
    app.observers.append(app.metrics.observe)
    app.serving_lock = None
    app.request_trace = None
    app.config.update(
        MAX_CONTENT_LENGTH=settings.max_body_bytes,
        BODY_TIMEOUT=settings.body_timeout,
        BACKGROUND_TASK_SHUTDOWN_TIMEOUT=settings.drain_timeout + SHUTDOWN_MARGIN,
        PROVIDE_AUTOMATIC_OPTIONS=True,
    )
    make_engine = engine_factory or default_engine
    started_at = int(time.time())
    watchdog = trio.CancelScope()

    @app.before_serving
    async def start_engine() -> None:
        _connections.raise_soft_limit()  # every connection is a descriptor (_connections.py)
        _connections.quiet_accept_errors()
        _intake.return_large_allocations()
        try:
            if not settings.allow_multiple_workers:
                app.serving_lock = _workers.acquire(settings)
            engine = app.engine = make_engine(settings)
            await app.nursery.start(engine.run)
            if settings.tuning.step_trace:
                app.request_trace = RequestTrace(request_trace_path(settings.tuning.step_trace))
                app.observers.append(app.request_trace.observe)
        except BaseException as exc:
            _release(app)
            app.start_failure = exc
            if isinstance(exc, Exception):  # where the server would not exit non-zero, exit (_exit.py)
                holder = (exc.holder, exc.holder_parent) if isinstance(exc, _workers.AlreadyServing) else None
                _exit.exit_if_unseen(
                    app.asgi_server, str(exc) if holder else f"trio_mlx could not start: {exc}",
                    lock_holder=holder, others_may_serve=settings.allow_multiple_workers)
            log.error("trio_mlx could not start: %s", exc)
            raise
        app.nursery.start_soon(_run_in(watchdog, app.pump.watch_stalls, _intake.trimmer,
                                       partial(_exit_when_broken, app, engine)))
        info = engine.info
        cache = info.prompt_cache_bytes if info else 0
        log.info("ready: serving %r (%s, context %s tokens, max batch %d) on %s%s, %s actor (pid %s), %s",
                 settings.served_model_name, info.model_type if info else "?",
                 engine.context_length, settings.tuning.max_batch, info.device if info else "?",
                 f" with {info.blas}" if info and info.blas else "", _actor_name(engine),
                 info.pid if info else "?",
                 f"prompt cache up to {cache / 1e9:.2f} GB" if cache else "prompt cache off")
        log.info("sampling defaults (generation_config %s): %s", settings.generation_config,
                 ", ".join(f"{k}={v}" for k, v in engine.sampling_defaults.items()) or "none")
        if engine.group is not None:
            log.info("distributed: %s", engine.group.describe())

    @app.after_serving
    async def stop_engine() -> None:
        try:
            await app.drain()
        finally:
            watchdog.cancel()
            _release(app)
            if app.request_trace is not None:
                app.request_trace.close()

    @app.before_request
    async def authenticate() -> None:
        if request.method != "OPTIONS" and request.path.startswith("/v1/"):
            check_api_key(request.headers.get("Authorization"), settings.api_key)

    @app.after_request
    async def add_cors(response: Response) -> Response:
        origin = request.headers.get("Origin")
        for key, value in cors_headers(origin, settings.cors_origins, preflight=request.method == "OPTIONS"):
            response.headers[key.decode()] = value.decode()
        scope: dict[str, Any] = request.scope  # type: ignore[assignment]
        rid = scope[REQUEST_ID] = request_id(scope, new_id("req-"))
        response.headers["X-Request-Id"] = rid
        if (refusal := scope.pop(_REFUSAL, None)) is not None:
            log_refusal(refusal, rid)
        rule = request.url_rule
        app.metrics.observe_route(rule.rule if rule is not None else "unmatched", response.status_code)
        return response

    def model_card() -> dict[str, Any]:
        engine = app.engine
        return {"id": settings.served_model_name, "object": "model", "created": started_at,
                "owned_by": "trio_mlx", "context_length": engine.context_length if engine else None,
                "root": str(engine.model_path) if engine and engine.model_path else None,  # as vLLM
                # what a request that leaves these out samples with (the model's generation_config.json)
                "sampling_defaults": dict(engine.sampling_defaults) if engine else None}

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/<path:model_id>")
    async def get_model(model_id: str) -> Response:
        if model_id != settings.served_model_name:
            raise HTTPError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return json_response(model_card())

    @app.get("/health")
    async def health() -> Response:
        """Liveness: 200 while the actor is alive and stepping or idle."""
        engine = app.engine
        if engine is None:
            return json_response({"status": "starting"})
        stats = engine.statistics()
        body: dict[str, Any] = {"status": "ok", "state": stats.state, "queued": stats.queued,
                                "prefilling": stats.prefilling, "decoding": stats.decoding}
        if engine.info is not None:
            body.update(actor=_actor_name(engine), actor_pid=engine.info.pid)
        if engine.group is not None:
            body["group"] = engine.group.snapshot()
        if stats.state in ("broken", "closed"):
            body["status"] = stats.state
            return json_response(body, 503)
        if stats.state == "restarting":  # alive, and recovering by itself: not a liveness failure
            body.update(status="restarting", actor_restarts=stats.actor_restarts)
            return json_response(body)
        since = stats.seconds_since_step
        if since is not None and since > settings.watchdog_seconds:
            body.update(status="stalled", seconds_since_step=_stalled_for(since))
            return json_response(body, 503)
        return json_response(body)

    @app.get("/ready")
    @app.get("/health/ready")
    async def ready() -> Response:
        """Readiness: 200 once the model is loaded and warm, 503 before, while the actor restarts,
        while draining, and while the actor is stalled (as /health says)."""
        state = app.engine.state if app.engine is not None else "starting"
        if state == "ready":
            since = app.engine.statistics().seconds_since_step if app.engine is not None else None
            if since is not None and since > settings.watchdog_seconds:
                return json_response({"status": "stalled", "seconds_since_step": _stalled_for(since)}, 503)
            return json_response({"status": "ready"})
        retry = {"Retry-After": "5"} if state in ("starting", "restarting") else None
        return json_response({"status": state}, 503, retry)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus metrics (text format): per-request histograms and counters, engine gauges."""
        body, content_type = app.metrics.render(request.headers.get("Accept"))
        return Response(body, status=200, content_type=content_type)

    openapi_doc: list[dict[str, Any]] = []  # built once, by the first request for it

    @app.get("/openapi.json")
    async def openapi() -> Response:
        if not openapi_doc:  # the module's import and pydantic's schemas (~70 ms on the CPU dev
            # box) in a worker thread, not on the event loop that every stream shares
            openapi_doc.append(await trio.to_thread.run_sync(_openapi_document, settings))
        return json_response(openapi_doc[0])

    def index_json() -> Response:
        return json_response({"name": "trio_mlx", "model": settings.served_model_name,
                              "endpoints": [CHAT_PATH, COMPLETIONS_PATH, *app.wire_apis, "/v1/models", "/health",
                                            "/ready", "/metrics", "/openapi.json", "/docs"]})

    add_pages(app, index_json)  # `/`: the chat page for browsers, index_json for API clients

    def error_response(error: HTTPError, headers: dict[str, str]) -> Response:
        """`error` in the shape of the API whose path was asked for (`wire_api_under`)."""
        scope: dict[str, Any] = request.scope  # type: ignore[assignment]
        scope[_REFUSAL] = error  # logged with its request id (add_cors)
        api = app.wire_api_under(request.path)
        if api is None:
            return json_response(error.payload(), error.status, headers)
        return Response(api.error_body(error), status=error.status, headers=headers, content_type="application/json")

    @app.errorhandler(HTTPError)
    async def api_error(error: HTTPError) -> Response:
        return error_response(error, dict(error.headers))

    @app.errorhandler(HTTPException)
    async def http_exception(exc: HTTPException) -> Response:
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
            error = HTTPError(413, f"the request body is larger than {settings.max_body_bytes} bytes",
                              code="request_too_large")
        elif status >= 500:
            error = HTTPError(status, "internal server error", type="server_error", code="internal_error")
        else:
            error = HTTPError(status, exc.description or exc.name, code=exc.name.lower().replace(" ", "_"))
        return error_response(error, headers)

    @app.errorhandler(Exception)
    async def internal_error(exc: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.path)
        error = HTTPError(500, "internal server error", type="server_error", code="internal_error")
        return json_response(error.payload(), 500)

    return app


def wire_apis() -> dict[str, WireAPI]:
    from . import anthropic, responses

    return {anthropic.MESSAGES_PATH: anthropic.MessagesAPI(),
            anthropic.COUNT_TOKENS_PATH: anthropic.CountTokensAPI(),
            responses.RESPONSES_PATH: responses.ResponsesAPI()}


async def _exit_when_broken(app: TrioMLXApp, engine: Engine) -> None:
    """An engine past its restart budget serves nothing more: stop the server, non-zero, so
    that the process supervisor (systemd, Kubernetes) takes over (engine/_supervise.py)."""
    await engine.wait_broken()
    budget = engine.restart_budget
    app.on_fatal(f"the GPU actor died and was not restarted (restart limit {budget.limit} "
                 f"within {budget.window:g} s): {engine.actor_error!r}")


def _release(app: TrioMLXApp) -> None:
    if app.serving_lock is not None:
        app.serving_lock.release()
        app.serving_lock = None


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status=status, headers=headers, content_type="application/json")


def _run_in(scope: trio.CancelScope, *fns: Callable[[], Any]) -> Callable[[], Any]:
    async def run() -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                for fn in fns:
                    nursery.start_soon(fn)

    return run


def _stalled_for(since: float) -> float:
    """Seconds since the last step, for a "stalled" answer: rounded up to the millisecond, so
    that the figure is past the watchdog whenever the status says so (0.3002 s would round
    to 0.3, no more than a watchdog of 0.3)."""
    return math.ceil(since * 1000) / 1000
