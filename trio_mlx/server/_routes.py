"""Every endpoint of the server in one table, `ROUTES`: its path, methods, handler and what it is.

The app's dispatch is built from it (`TrioMLXApp`, `server/_app.py`): a route marked `asgi`
is served on raw ASGI before Quart sees the request (the generation endpoints: their handler
answers its own methods, OPTIONS and errors, in its API's shape); every other route becomes
a Quart route. The JSON index at `GET /` is the table's `listed` paths, in its order; the
OpenAPI document (`_openapi.py`) describes its `documented` ones, under their summaries; the
metrics count the outcomes of its `generates` ones from the start (`GENERATION_PATHS`). A new
endpoint is one entry here (and, if documented, its schemas in `_openapi.py`);
tests/unit/test_routes.py checks that every route is served and that the index and the
OpenAPI document hold the table's paths and nothing else.

Handlers are module functions of the app: a Quart route's takes `(app, **its path's
parameters)` and returns a Response; a raw one takes `(app, scope, receive, send)`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import trio
from quart import Response, request

from .._errors import TrioMLXError
from . import _pages
from ._adapters import pick_adapter, pick_model
from ._http import HTTPError, dumps, error_from_exception
from ._records import CHAT_PATH, COMPLETIONS_PATH, ServerHost
from ._wire import WireAPI, serve_api
from .anthropic import COUNT_TOKENS_PATH, MESSAGES_PATH, CountTokensAPI, MessagesAPI
from .responses import RESPONSES_PATH, ResponsesAPI

if TYPE_CHECKING:
    from ..engine import Engine
    from ._asgi import Receive, Scope, Send
    from ._metrics import Metrics
    from ._pump import Pump
    from .openai._serving import Completions


class RouteHost(ServerHost, Protocol):
    """The app, as the handlers below see it (`TrioMLXApp` is the one implementation)."""

    pump: Pump
    completions: Completions
    metrics: Metrics
    started_at: int  # the model cards' `created`
    openapi_doc: dict[str, Any] | None  # built by the first request for it


GET = ("GET",)
POST = ("POST",)


@dataclass(frozen=True, slots=True)
class Route:
    path: str  # Quart's rule syntax: `/v1/models/<path:model_id>`
    methods: tuple[str, ...]  # what it serves (OPTIONS and HEAD come with them)
    handler: Callable[..., Awaitable[Any]]
    summary: str  # what it is, in a line
    asgi: bool = False  # served on raw ASGI, before Quart
    listed: bool = True  # in the index at `/`
    documented: bool = True  # in the OpenAPI document (`_openapi.py`): the API, not the pages
    generates: bool = False  # generates tokens: its requests' records carry tokens and timings
    api: WireAPI | None = None  # the API whose shape its errors take (`_wire.py`); None: OpenAI's


# ------------------------------------------------------------- the generation endpoints


async def completions(app: RouteHost, scope: Scope, receive: Receive, send: Send) -> None:
    """OpenAI's Chat Completions and Completions (`openai/_serving.py`)."""
    await app.completions(scope, receive, send)


def wire(path: str, api: WireAPI, summary: str, *, generates: bool = True) -> Route:
    """The route of another API's endpoint, on the shared machinery (`_wire.py`)."""

    async def handler(app: RouteHost, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_api(app.pump, api, scope, receive, send)

    return Route(path, POST, handler, summary, asgi=True, generates=generates, api=api)


# ------------------------------------------------------------------------- models and probes


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status=status, headers=headers, content_type="application/json")


def model_card(app: RouteHost) -> dict[str, Any]:
    engine = app.engine
    return {"id": app.settings.served_model_name, "object": "model", "created": app.started_at,
            "owned_by": "trio_mlx", "context_length": engine.context_length if engine else None,
            "root": str(engine.model_path) if engine and engine.model_path else None,  # as vLLM
            "adapter": app.settings.tuning.adapter_path,  # the LoRA adapter served over it, or None
            # what a request that leaves these out samples with (the model's generation_config.json)
            "sampling_defaults": dict(engine.sampling_defaults) if engine else None}


def adapter_card(app: RouteHost, name: str) -> dict[str, Any]:
    """A named LoRA adapter's entry in /v1/models, as vLLM lists its LoRA modules: its
    `parent` the served model, its `root` the adapter's directory."""
    engine = app.engine
    return {"id": name, "object": "model", "created": app.started_at, "owned_by": "trio_mlx",
            "context_length": engine.context_length if engine else None,
            "root": app.settings.tuning.adapter_map[name], "parent": app.settings.served_model_name}


def pool_card(app: RouteHost, name: str) -> dict[str, Any]:
    """A model of several (`--models`) in /v1/models: `loaded` says whether it is in memory
    now (a request for one that is not waits for its load)."""
    assert app.pool is not None
    engine = app.pool.engine(name)
    state = next(s.state for s in app.pool.status() if s.name == name)
    return {"id": name, "object": "model", "created": app.started_at, "owned_by": "trio_mlx",
            "context_length": engine.context_length if engine else None,
            "root": app.settings.model_table[name], "loaded": state == "loaded", "state": state,
            "sampling_defaults": dict(engine.sampling_defaults) if engine else None}


def pool_adapter_card(app: RouteHost, model: str, name: str) -> dict[str, Any]:
    """A named adapter over a model of several (`--model-adapter`): id `MODEL:NAME`, `parent`
    the model, `loaded` and `state` the model's (the adapter loads with it)."""
    card = pool_card(app, model)
    card.pop("sampling_defaults")
    return {**card, "id": f"{model}:{name}", "root": app.settings.model_adapter_map[model][name], "parent": model}


async def list_models(app: RouteHost) -> Response:
    if app.pool is not None:
        cards = []
        for model in app.pool.names:
            cards.append(pool_card(app, model))
            cards += [pool_adapter_card(app, model, a) for a in app.settings.model_adapter_map.get(model, {})]
        return json_response({"object": "list", "data": cards})
    adapters = [adapter_card(app, name) for name in app.settings.tuning.adapter_map]
    return json_response({"object": "list", "data": [model_card(app), *adapters]})


async def unload_model(app: RouteHost) -> Response:
    """`POST /models/unload` with `{"model": ID}`, as llama-server's router mode takes it (a
    path outside `/v1/models/`, whose model ids may hold slashes): with `--models`, unload
    the model now if it is idle (409 `model_busy` when it serves, loads or unloads); a later
    request loads it again. An adapter loads and unloads with its model."""
    try:
        body = json.loads(await request.get_data(as_text=False) or b"null")
    except ValueError:
        body = None
    model_id = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model_id, str) or not model_id:
        raise HTTPError(400, 'the body must be a JSON object naming the model: {"model": "NAME"}', param="model",
                        code="invalid_value")
    adapter = pick_adapter(app.settings, model_id)  # 404 for a name the server does not serve
    if app.pool is None:
        raise HTTPError(400, "this server serves one model, loaded for its whole life; unloading is for "
                        "a server of several models (--models)", code="not_supported")
    model = pick_model(app.settings, model_id)
    if adapter is not None:
        raise HTTPError(400, f"{model_id!r} is an adapter: it loads and unloads with its model; unload "
                        f"{model!r}", param="model", code="invalid_value")
    try:
        unloaded = await app.pool.unload(model)
    except TrioMLXError as exc:
        raise error_from_exception(exc) from None
    return json_response({"id": model, "object": "model", "unloaded": unloaded, "state": "unloaded"})


async def get_model(app: RouteHost, model_id: str) -> Response:
    adapter = pick_adapter(app.settings, model_id)  # 404 for a name the server does not serve
    if app.pool is not None:
        model = pick_model(app.settings, model_id)
        card = pool_card(app, model) if adapter is None else pool_adapter_card(app, model, adapter)
        return json_response(card)
    return json_response(model_card(app) if adapter is None else adapter_card(app, adapter))


def actor_name(engine: Engine) -> str:
    return engine.actor_mode if isinstance(engine.actor_mode, str) else "thread"


async def health(app: RouteHost) -> Response:
    """Liveness: 200 while the actor is alive and stepping or idle."""
    engine = app.engine
    if app.pool is not None:  # several models: each one's state and requests in flight
        return json_response({"status": "ok", "models": {
            s.name: {"state": s.state, "in_flight": s.in_flight} for s in app.pool.status()}})
    if engine is None:
        return json_response({"status": "starting"})
    stats = engine.statistics()
    body: dict[str, Any] = {"status": "ok", "state": stats.state, "queued": stats.queued,
                            "prefilling": stats.prefilling, "decoding": stats.decoding}
    if engine.info is not None:
        body.update(actor=actor_name(engine), actor_pid=engine.info.pid)
    if app.settings.replica is not None:
        body["replica"] = app.settings.replica
    if engine.group is not None:
        body["group"] = engine.group.snapshot()
    if stats.state in ("broken", "closed"):
        body["status"] = stats.state
        return json_response(body, 503)
    if stats.state == "restarting":  # alive, and recovering by itself: not a liveness failure
        body.update(status="restarting", actor_restarts=stats.actor_restarts)
        return json_response(body)
    since = stats.seconds_since_step
    if since is not None and since > app.settings.watchdog_seconds:
        body.update(status="stalled", seconds_since_step=_stalled_for(since))
        return json_response(body, 503)
    return json_response(body)


async def ready(app: RouteHost) -> Response:
    """Readiness: 200 once the model is loaded and warm, 503 before, while the actor restarts,
    while draining, and while the actor is stalled (as /health says)."""
    engine = app.engine
    if app.pool is not None:  # several models: ready once the GPU thread runs (models load on demand)
        if app.pool.closing:
            return json_response({"status": "draining"}, 503)
        return json_response({"status": "ready"})
    state = engine.state if engine is not None else "starting"
    if state == "ready":
        since = engine.statistics().seconds_since_step if engine is not None else None
        if since is not None and since > app.settings.watchdog_seconds:
            return json_response({"status": "stalled", "seconds_since_step": _stalled_for(since)}, 503)
        return json_response({"status": "ready"})
    retry = {"Retry-After": "5"} if state in ("starting", "restarting") else None
    return json_response({"status": state}, 503, retry)


def _stalled_for(since: float) -> float:
    """Seconds since the last step, for a "stalled" answer: rounded up to the millisecond, so
    that the figure is past the watchdog whenever the status says so (0.3002 s would round
    to 0.3, no more than a watchdog of 0.3)."""
    return math.ceil(since * 1000) / 1000


# ------------------------------------------------------------------ what a router reads
# A router in front of several replicas (sglang-router's cache-aware policy, docs/distributed.md,
# "Scaling out") asks each worker once what it serves (SGLang's /server_info and /model_info,
# which name its model in the router's /v1/models) and, for its load-based policies, its load
# (/get_load); vLLM's router asks the same.


async def server_info(app: RouteHost) -> Response:
    """The served model's name and directory, this replica's name and the batch's bound, in the
    fields SGLang's /server_info has."""
    engine = app.engine
    return json_response({
        "served_model_name": app.settings.served_model_name,
        "model_path": str(engine.model_path) if engine and engine.model_path else None,
        "adapter_path": app.settings.tuning.adapter_path,
        "adapters": app.settings.tuning.adapter_map or {  # the named ones: {name: directory}
            f"{m}:{a}": path for m, over in app.settings.model_adapter_map.items() for a, path in over.items()},
        "replica": app.settings.replica,
        "max_running_requests": app.settings.tuning.max_batch,
        "max_queued_requests": app.settings.max_queue,
        "context_length": engine.context_length if engine else None,
        "state": engine.state if engine else "starting",
    })


async def model_info(app: RouteHost) -> Response:
    """The model's family and architectures (its config.json), in SGLang's /model_info fields."""
    engine = app.engine
    path = engine.model_path if engine else None
    config = await trio.to_thread.run_sync(_model_config, path) if path else {}
    return json_response({
        "model_path": str(path) if path else None,
        "tokenizer_path": str(path) if path else None,
        "is_generation": True,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
    })


def _model_config(path: Any) -> dict[str, Any]:
    import json
    import pathlib

    try:
        config = json.loads((pathlib.Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


async def get_load(app: RouteHost) -> Response:
    """The load now, as SGLang's /get_load reports it (one entry per data-parallel rank; this
    server is one): requests decoding or prefilling, requests queued, and the prompts' tokens of
    all of them."""
    engines = app.pool.loaded() if app.pool is not None else [app.engine] if app.engine is not None else []
    every = [engine.statistics() for engine in engines]  # with --models: the loaded models' sum
    return json_response([{
        "dp_rank": 0,
        "num_reqs": sum(s.prefilling + s.decoding for s in every),
        "num_waiting_reqs": sum(s.queued for s in every),
        "num_tokens": sum(s.prompt_tokens_in_flight for s in every),
    }])


async def metrics(app: RouteHost) -> Response:
    """Prometheus metrics (text format): per-request histograms and counters, engine gauges."""
    body, content_type = app.metrics.render(request.headers.get("Accept"))
    return Response(body, status=200, content_type=content_type)


async def openapi(app: RouteHost) -> Response:
    if app.openapi_doc is None:  # the module's import and pydantic's schemas (~70 ms on the CPU
        # dev box) in a worker thread, not on the event loop that every stream shares
        app.openapi_doc = await trio.to_thread.run_sync(_openapi_document, app)
    return json_response(app.openapi_doc)


def _openapi_document(app: RouteHost) -> dict[str, Any]:
    """The OpenAPI document (`_openapi.py`, imported only when asked for)."""
    from . import _openapi

    return _openapi.openapi_document(app.settings, ROUTES)


async def index(app: RouteHost) -> Response:
    """`GET /`: the listed endpoints for API clients, the chat page for browsers (`_pages.py`)."""

    def listing() -> Response:
        return json_response({"name": "trio_mlx", "model": app.settings.served_model_name,
                              "endpoints": INDEX})

    return await _pages.front(listing)


# ----------------------------------------------------------------------------------- the table

ROUTES: tuple[Route, ...] = (
    Route(CHAT_PATH, POST, completions, "OpenAI's Chat Completions", asgi=True, generates=True),
    Route(COMPLETIONS_PATH, POST, completions, "OpenAI's (text) Completions", asgi=True, generates=True),
    wire(MESSAGES_PATH, MessagesAPI(), "Anthropic's Messages API"),
    wire(COUNT_TOKENS_PATH, CountTokensAPI(), "Anthropic's token count of a request", generates=False),
    wire(RESPONSES_PATH, ResponsesAPI(), "OpenAI's Responses API (stateless)"),
    Route("/v1/models", GET, list_models, "The served model"),
    Route("/v1/models/<path:model_id>", GET, get_model, "One model", listed=False),
    Route("/models/unload", POST, unload_model, 'Unload an idle model now (--models): {"model": NAME}',
          listed=False),
    Route("/health", GET, health, "Liveness: the GPU actor is alive and stepping or idle"),
    Route("/ready", GET, ready, "Readiness: the model is loaded and warm, not draining"),
    Route("/health/ready", GET, ready, "Readiness (alias of /ready)", listed=False),
    Route("/metrics", GET, metrics, "Prometheus metrics (text exposition format)"),
    Route("/server_info", GET, server_info, "The served model and this replica, for a router"),
    Route("/get_server_info", GET, server_info, "Alias of /server_info", listed=False, documented=False),
    Route("/model_info", GET, model_info, "The model's family and architectures, for a router"),
    Route("/get_model_info", GET, model_info, "Alias of /model_info", listed=False, documented=False),
    Route("/get_load", GET, get_load, "Requests running and queued, and their prompts' tokens, for a router"),
    Route("/openapi.json", GET, openapi, "This API's OpenAPI document", documented=False),
    Route("/docs", GET, _pages.docs, "Swagger UI over /openapi.json", documented=False),
    Route("/", GET, index, "This index (JSON), or the chat page for browsers", listed=False, documented=False),
    Route("/static/<path:name>", GET, _pages.static_file, "The chat page's files", listed=False,
          documented=False),
    Route("/docs/assets/<path:name>", GET, _pages.docs_asset, "Swagger UI's files", listed=False,
          documented=False),
)

INDEX = [route.path for route in ROUTES if route.listed]
GENERATION_PATHS = tuple(route.path for route in ROUTES if route.generates)
# The other APIs' endpoints by path: a path under one of them takes its error shape (`api_under`).
WIRE_APIS = {route.path: route.api for route in ROUTES if route.api is not None}


def api_under(path: str) -> WireAPI | None:
    """The other API whose path `path` is, or lies under: its errors take that API's shape
    (an Anthropic SDK reads only Anthropic's errors, `/v1/messages/batches` included)."""
    return next((a for p, a in WIRE_APIS.items() if path == p or path.startswith(p + "/")), None)
