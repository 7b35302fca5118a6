"""The OpenAPI 3.1 document of the server (`GET /openapi.json`), made from the route table
and the pydantic models.

Its paths, methods and summaries are the route table's documented routes (`_routes.ROUTES`),
in its order; which need the API key is the app's own rule (`_asgi.needs_key`). What this
module adds is each route's schemas (`_OPERATIONS`, by the route's path): a documented route
without them, or schemas for a path the table lacks, fails the document's build.
Request schemas are the very models that validate requests (`openai/_protocol.py` and the
other APIs' `_protocol.py`); the response models below exist only to document what the
builders emit. Built by the app once, in a worker thread, at the first request for it
(`_routes.openapi`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from ._asgi import needs_key
from ._records import CHAT_PATH, COMPLETIONS_PATH, COUNT_TOKENS_PATH, MESSAGES_PATH, RESPONSES_PATH
from ._settings import Settings
from .anthropic._protocol import CountTokensRequest, MessagesRequest
from .openai._protocol import ChatCompletionRequest, CompletionRequest
from .responses._protocol import ResponsesRequest

if TYPE_CHECKING:
    from ._wire import WireAPI


class DocumentedRoute(Protocol):
    """A route of the table (`_routes.Route`), as the document reads it."""

    @property
    def path(self) -> str: ...  # Quart's rule syntax: `/v1/models/<path:model_id>`
    @property
    def methods(self) -> tuple[str, ...]: ...
    @property
    def summary(self) -> str: ...
    @property
    def documented(self) -> bool: ...
    @property
    def api(self) -> WireAPI | None: ...


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Doc):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Doc):
    error: ErrorDetail


class PromptTokensDetails(_Doc):
    cached_tokens: int  # prompt tokens served from the prompt cache, not prefilled again


class CompletionTokensDetails(_Doc):
    accepted_prediction_tokens: int  # speculative decoding: drafted tokens kept in the completion
    rejected_prediction_tokens: int  # ... and drafted tokens not kept


class UsageInfo(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None  # with speculative decoding only


class CalledFunction(_Doc):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallOut(_Doc):
    id: str
    type: Literal["function"]
    function: CalledFunction


class FunctionDelta(_Doc):
    name: str | None = None  # in a call's first chunk
    arguments: str  # "" in a call's first chunk, then the next fragment of its JSON text


class ToolCallDelta(_Doc):
    """A streamed call: its first chunk has index, id, type and function.name (arguments
    ""), the next ones index and an arguments fragment; joined by index they are the
    call. Families whose calls do not stream send each call whole in one chunk."""

    index: int  # the call's position among the choice's calls
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class AssistantMessage(_Doc):
    role: Literal["assistant"]
    content: str | None  # null when the reply is only tool calls
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None


class ChatChoice(_Doc):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(_Doc):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(_Doc):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(_Doc):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionChunk(_Doc):
    """One `data:` event of a streamed chat completion (the stream ends with `data: [DONE]`)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length"] | None


class Completion(_Doc):
    """A completion, or (object "text_completion", streamed) one `data:` event of one."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    context_length: int | None
    root: str | None = Field(None, description="the model directory the server loaded; for a named LoRA "
                             "adapter, its directory")
    parent: str | None = Field(None, description="a named LoRA adapter's: the served model it adapts (a request "
                               "names the adapter as its model: NAME or PARENT:NAME, with --models PARENT:NAME only); absent for the model")
    adapter: str | None = Field(None, description="the LoRA adapter directory applied over it (adapter_path), "
                                "or null")
    sampling_defaults: dict[str, float] | None = Field(
        None, description="what a request that leaves temperature, top_p, top_k, min_p or "
        "repetition_penalty out samples with: the model's generation_config.json")


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class Status(_Doc):
    status: str


class AnthropicErrorDetail(_Doc):
    type: str
    message: str


class AnthropicError(_Doc):
    """Anthropic's error shape (the /v1/messages endpoints)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicUsage(_Doc):
    input_tokens: int
    output_tokens: int


class AnthropicMessage(_Doc):
    """A message of Anthropic's API: content blocks of type text and tool_use."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: AnthropicUsage


class MessageTokensCount(_Doc):
    input_tokens: int


class ResponseUsage(_Doc):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class ResponseObject(_Doc):
    """A response of OpenAI's Responses API: output items of type message and function_call."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage


_MODELS: list[type[BaseModel]] = [
    ChatCompletionRequest, CompletionRequest, ChatCompletion, ChatCompletionChunk, Completion,
    ModelList, ModelCard, ErrorResponse, Status, MessagesRequest, CountTokensRequest, AnthropicMessage,
    AnthropicError, MessageTokensCount, ResponsesRequest, ResponseObject,
]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _errors(*statuses: int, model: type[BaseModel] = ErrorResponse) -> dict[str, Any]:
    text = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model or URL",
            403: "Host not allowed (a loopback connection naming another host)",
            405: "method not allowed", 413: "body too large", 415: "body not sent as application/json", 429: "queue full (see Retry-After)",
            500: "internal error", 503: "not ready, draining, or broken (see Retry-After)"}
    return {str(s): {"description": text[s], "content": _json(model)} for s in statuses}


# One server-sent event (what `schema` of an event stream describes before OpenAPI 3.2's
# `itemSchema`): its data is a JSON chunk, a JSON error ({"error": ...}) or the text [DONE].
_SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string", "description": "a JSON chunk, a JSON error object, or [DONE] (the last event)"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


def _completion_op(request: type[BaseModel], whole: type[BaseModel], chunk: type[BaseModel]) -> dict[str, Any]:
    return {
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {
            "200": {"description": f"a {whole.__name__}, or with stream=true server-sent events: "
                                   f"`data: <{chunk.__name__}>` ... then `data: [DONE]`",
                    "content": {**_json(whole), "text/event-stream": {"schema": _SSE_EVENT}}},
            **_errors(400, 401, 403, 404, 413, 415, 429, 500, 503),
        },
    }


def _api_op(request: type[BaseModel], whole: type[BaseModel], events: str | None,
            error: type[BaseModel] = ErrorResponse) -> dict[str, Any]:
    """An endpoint of another API (Anthropic's, the Responses API): `event:` + `data:` events."""
    content = _json(whole)
    description = f"a {whole.__name__}"
    if events:
        content["text/event-stream"] = {"schema": _SSE_EVENT}
        description += f", or with stream=true server-sent events ({events})"
    return {
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {"200": {"description": description, "content": content},
                      **_errors(400, 401, 403, 404, 413, 415, 429, 500, 503, model=error)},
    }


def _get(model: type[BaseModel], *errors: int) -> dict[str, Any]:
    return {"responses": {"200": {"description": "OK", "content": _json(model)}, **_errors(*errors)}}


_PROBE: dict[str, Any] = {"responses": {"200": {"description": "OK", "content": _json(Status)},
                                        "503": {"description": "not OK", "content": _json(Status)}}}

_ROUTER_PROBE: dict[str, Any] = {"responses": {"200": {"description": "OK", "content": {
    "application/json": {"schema": {"type": "object"}}}}}}

# Each documented route's operation but its summary (the table's), by the route's path.
_OPERATIONS: dict[str, dict[str, Any]] = {
    CHAT_PATH: _completion_op(ChatCompletionRequest, ChatCompletion, ChatCompletionChunk),
    COMPLETIONS_PATH: _completion_op(CompletionRequest, Completion, Completion),
    MESSAGES_PATH: _api_op(MessagesRequest, AnthropicMessage,
                           "message_start, content_block_start/delta/stop, message_delta, message_stop",
                           AnthropicError),
    COUNT_TOKENS_PATH: _api_op(CountTokensRequest, MessageTokensCount, None, AnthropicError),
    RESPONSES_PATH: _api_op(ResponsesRequest, ResponseObject,
                            "response.created ... response.completed or response.incomplete"),
    "/v1/models": _get(ModelList, 401),
    "/v1/models/<path:model_id>": _get(ModelCard, 401, 404),
    "/models/unload": {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "required": ["model"], "properties": {"model": {"type": "string", "minLength": 1}}}}}},
                       "responses": {
        "200": {"description": "unloaded (`unloaded`: false when it was not loaded)",
                "content": {"application/json": {"schema": {"type": "object"}}}},
        **_errors(400, 401, 404), "409": {"description": "the model serves requests, loads or unloads",
                                          "content": _json(ErrorResponse)}}},
    "/health": _PROBE,
    "/ready": _PROBE,
    "/health/ready": _PROBE,
    "/metrics": {"responses": {
        "200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}}},
    # What a router reads of a worker: JSON bodies in SGLang's fields (docs/server.md)
    "/server_info": _ROUTER_PROBE,
    "/model_info": _ROUTER_PROBE,
    "/get_load": {"responses": {"200": {"description": "OK", "content": {
        "application/json": {"schema": {"type": "array", "items": {"type": "object"}}}}}}},
}

_PARAMETER = re.compile(r"<(?:[^:>]+:)?([^>]+)>")  # a Quart rule's `<converter:name>`


def openapi_path(path: str) -> str:
    """A route's path as OpenAPI writes it: `/v1/models/<path:model_id>` -> `/v1/models/{model_id}`."""
    return _PARAMETER.sub(r"{\1}", path)


def openapi_document(settings: Settings, routes: Sequence[DocumentedRoute]) -> dict[str, Any]:
    """The document of `routes`' documented ones (the app passes `_routes.ROUTES`)."""
    documented = [route for route in routes if route.documented]
    if missing := [r.path for r in documented if r.path not in _OPERATIONS]:
        raise LookupError(f"documented routes with no schemas in _openapi._OPERATIONS: {missing}")
    if unrouted := sorted(set(_OPERATIONS) - {r.path for r in documented}):
        raise LookupError(f"schemas in _openapi._OPERATIONS for no documented route: {unrouted}")
    _, top = models_json_schema([(m, "validation") for m in _MODELS],
                                ref_template="#/components/schemas/{model}")
    schemes: dict[str, Any] = {"bearer": {"type": "http", "scheme": "bearer"},
                               "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    paths: dict[str, Any] = {}
    for route in documented:
        op: dict[str, Any] = {"summary": route.summary, **_OPERATIONS[route.path]}
        if names := _PARAMETER.findall(route.path):
            op["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                                for n in names]
        if settings.api_key and needs_key(route.path):
            op["security"] = [{"bearer": []}]
            if route.api is not None and route.api.accept_x_api_key:
                op["security"].append({"x-api-key": []})
        paths[openapi_path(route.path)] = {m.lower(): op for m in route.methods}
    components: dict[str, Any] = {"schemas": top.get("$defs", {})}
    if settings.api_key:
        components["securitySchemes"] = schemes
    return {
        "openapi": "3.1.0",
        "info": {"title": "trio_mlx", "version": "0.1.0",
                 "description": f"OpenAI-compatible API serving {settings.served_model_name!r}"},
        "paths": paths,
        "components": components,
    }
