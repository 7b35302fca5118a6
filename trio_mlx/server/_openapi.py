"""The OpenAPI 3.1 document of the server (`GET /openapi.json`), made from the pydantic models.

Request schemas are the very models that validate requests (`_openai.py`);
the response models below exist only to document what the builders emit.
Built once per settings and cached.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from ._openai import ChatCompletionRequest, CompletionRequest
from ._settings import Settings


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Doc):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Doc):
    error: ErrorDetail


class UsageInfo(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(_Doc):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Doc):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length"]


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


class ChatChunkChoice(_Doc):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length"] | None


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


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class Status(_Doc):
    status: str


_MODELS: list[type[BaseModel]] = [
    ChatCompletionRequest, CompletionRequest, ChatCompletion, ChatCompletionChunk, Completion,
    ModelList, ModelCard, ErrorResponse, Status,
]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _errors(*statuses: int) -> dict[str, Any]:
    text = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model or URL",
            403: "Host not allowed (a loopback connection naming another host)",
            405: "method not allowed", 413: "body too large", 415: "body not sent as application/json", 429: "queue full (see Retry-After)",
            500: "internal error", 503: "not ready, draining, or broken (see Retry-After)"}
    return {str(s): {"description": text[s], "content": _json(ErrorResponse)} for s in statuses}


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


def _get(summary: str, model: type[BaseModel], *errors: int, params: list[Any] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary,
                          "responses": {"200": {"description": "OK", "content": _json(model)}, **_errors(*errors)}}
    if params:
        op["parameters"] = params
    return {"get": op}


@functools.cache
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
        },
        "components": {"schemas": top.get("$defs", {})},
    }
    if settings.api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}"):
            for op in doc["paths"][path].values():
                op["security"] = [{"bearer": []}]
    return doc
