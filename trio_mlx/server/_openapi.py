"""The OpenAPI 3.1 document of the server (`GET /openapi.json`), made from the pydantic models.

Request schemas are the very models that validate requests (`openai/_protocol.py` and the other APIs' `_protocol.py`);
the response models below exist only to document what the builders emit.
Built by the app once, in a worker thread, at the first request for it (`_app.py`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from ._settings import Settings
from .anthropic._protocol import CountTokensRequest, MessagesRequest
from .openai._protocol import ChatCompletionRequest, CompletionRequest
from .responses._protocol import ResponsesRequest


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


class UsageInfo(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


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
    root: str | None = Field(None, description="the model directory the server loaded")
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


def _completion_op(summary: str, request: type[BaseModel], whole: type[BaseModel],
                   chunk: type[BaseModel]) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {
            "200": {"description": f"a {whole.__name__}, or with stream=true server-sent events: "
                                   f"`data: <{chunk.__name__}>` ... then `data: [DONE]`",
                    "content": {**_json(whole), "text/event-stream": {"schema": _SSE_EVENT}}},
            **_errors(400, 401, 403, 404, 413, 415, 429, 500, 503),
        },
    }}


def _api_op(summary: str, request: type[BaseModel], whole: type[BaseModel], events: str | None,
            error: type[BaseModel] = ErrorResponse) -> dict[str, Any]:
    """An endpoint of another API (Anthropic's, the Responses API): `event:` + `data:` events."""
    content = _json(whole)
    description = f"a {whole.__name__}"
    if events:
        content["text/event-stream"] = {"schema": _SSE_EVENT}
        description += f", or with stream=true server-sent events ({events})"
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {"200": {"description": description, "content": content},
                      **_errors(400, 401, 403, 404, 413, 415, 429, 500, 503, model=error)},
    }}


def _get(summary: str, model: type[BaseModel], *errors: int, params: list[Any] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary,
                          "responses": {"200": {"description": "OK", "content": _json(model)}, **_errors(*errors)}}
    if params:
        op["parameters"] = params
    return {"get": op}


def _router_probe(summary: str, kind: str = "object") -> dict[str, Any]:
    """A GET a router makes of a worker: a JSON body in SGLang's fields (docs/server.md)."""
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK", "content": {
        "application/json": {"schema": {"type": kind}}}}}}}


def openapi_document(settings: Settings) -> dict[str, Any]:
    _, top = models_json_schema([(m, "validation") for m in _MODELS],
                                ref_template="#/components/schemas/{model}")
    probe = {"200": {"description": "OK", "content": _json(Status)},
             "503": {"description": "not OK", "content": _json(Status)}}
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "trio_mlx", "version": "0.1.0",
                 "description": f"OpenAI-compatible API serving {settings.served_model_name!r}"},
        "paths": {
            "/v1/chat/completions": _completion_op("Chat completion", ChatCompletionRequest, ChatCompletion,
                                                   ChatCompletionChunk),
            "/v1/completions": _completion_op("Text completion", CompletionRequest, Completion, Completion),
            "/v1/messages": _api_op(
                "Anthropic's Messages API", MessagesRequest, AnthropicMessage,
                "message_start, content_block_start/delta/stop, message_delta, message_stop",
                AnthropicError),
            "/v1/messages/count_tokens": _api_op("Anthropic's token count of a request", CountTokensRequest,
                                                 MessageTokensCount, None, AnthropicError),
            "/v1/responses": _api_op(
                "OpenAI's Responses API (stateless)", ResponsesRequest, ResponseObject,
                "response.created ... response.completed or response.incomplete"),
            "/v1/models": _get("The served model", ModelList, 401),
            "/v1/models/{model}": _get("One model", ModelCard, 401, 404, params=[
                {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]),
            "/health": {"get": {"summary": "Liveness: the GPU actor is alive and stepping or idle",
                                "responses": probe}},
            "/ready": {"get": {"summary": "Readiness: the model is loaded and warm, not draining",
                               "responses": probe}},
            "/health/ready": {"get": {"summary": "Readiness (alias of /ready)", "responses": probe}},
            "/metrics": {"get": {"summary": "Prometheus metrics (text exposition format)", "responses": {
                "200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/server_info": _router_probe("The served model and this replica, for a router (SGLang's fields)"),
            "/model_info": _router_probe("The model's family and architectures, for a router (SGLang's fields)"),
            "/get_load": _router_probe("Requests running and queued, and their prompts' tokens, for a router",
                                       "array"),
        },
        "components": {"schemas": top.get("$defs", {})},
    }
    if settings.api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["components"]["securitySchemes"]["x-api-key"] = {"type": "apiKey", "in": "header",
                                                              "name": "x-api-key"}
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}",
                     "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"):
            for op in doc["paths"][path].values():
                op["security"] = [{"bearer": []}]
                if path.startswith("/v1/messages"):
                    op["security"].append({"x-api-key": []})
    return doc
