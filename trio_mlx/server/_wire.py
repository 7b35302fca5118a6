"""How an API other than OpenAI's completions plugs into the shared machinery.

Anthropic's Messages API (`server/anthropic/`) and OpenAI's Responses API
(`server/responses/`) share everything of `_pump.py` that is not their
shape on the wire: the request checks (method, API key, body limit, JSON), the
engine, the stream pump with its pings, pacing and stall watchdog, aborts on
disconnect, and the request records that metrics and logs read. What an API
brings is a `WireAPI`: it parses a body into a call, renders errors in its
own shape, and its calls translate to and from the engine (`engine.chat`).
`serve_api` is the ASGI handler of one such endpoint, and `api_error` names an
engine error's field as the API names it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Protocol, cast

import trio

from .._errors import InvalidRequestError
from ..engine import Engine, GenerationOptions, RequestStream
from ._adapters import answered_as, pick_adapter
from ._asgi import (
    JSON_HEADERS,
    REQUEST_ID,
    Disconnected,
    Receive,
    Scope,
    Send,
    request_id,
    scope_cors,
    send_error,
    send_response,
    unless_disconnected,
)
from ._http import HTTPError, new_id
from ._pump import ChoiceResult, Pump, StreamEncoder, read_json_request, refuse
from ._records import RequestRecord

log = logging.getLogger("trio_mlx.http")


class ApiCall(Protocol):
    """One parsed request."""

    model: str | None
    stream: bool

    async def start(self, engine: Engine) -> RequestStream:
        """The engine request, entered (submitted); raises what entering raises."""

    def encoder(self, rid: str, model: str, prompt_tokens: int, cached: Callable[[], int] | None = None) -> StreamEncoder:
        """The stream's encoder; `cached()`: the prompt's tokens the prompt cache gave, known
        by the first event."""

    def whole(self, rid: str, model: str, result: ChoiceResult) -> bytes:
        """The body of a whole (not streamed) answer."""


class ImmediateCall(Protocol):
    """A request answered without generating (Anthropic's count_tokens)."""

    model: str | None

    async def respond(self, engine: Engine) -> bytes: ...


class WireAPI(Protocol):
    id_prefix: str  # of the request ids it makes (the X-Request-Id default)
    accept_x_api_key: bool  # the API key may come as `x-api-key` (Anthropic's clients)

    def parse(self, obj: dict[str, Any]) -> ApiCall | ImmediateCall:
        """The request body -> a call; raises HTTPError or pydantic's ValidationError."""

    def error_body(self, err: HTTPError) -> bytes:
        """An error response body in this API's shape."""


# The leading place an engine error's message names (`tools[0].function.name` of
# "tools[0].function.name must be ..."): most of its messages start with their param.
_PLACE = re.compile(r"[\w.\[\]]+")


def api_error(exc: InvalidRequestError, params: Mapping[str, str],
              inner: Mapping[str, str] | None = None) -> InvalidRequestError:
    """The engine's error for a translated request, in that API's names.

    `params` is the API's table: the name of its parameter for each `GenerationOptions`
    field (and `messages`) it builds. The error's `field` picks the name; the place inside
    the field is kept, except an index into `messages`, which points into the translated
    chat and not the client's list, and the `.function.` level of OpenAI's tool shape;
    `inner` renames the place's parts the API names otherwise (Anthropic's `input_schema`
    for `parameters`). A message that starts with that field's place starts with the API's.
    """
    field = exc.field
    name = params.get(field) if field else None
    if field is None or name is None:
        return exc

    def place(where: str) -> str:
        rest = where[len(field):]
        if field == "messages" and rest.startswith("["):
            rest = rest[rest.find("]") + 1:]
        rest = rest.replace(".function.", ".")
        for theirs, ours in (inner or {}).items():
            rest = rest.replace(theirs, ours)
        return name + rest

    message = exc.message
    lead = _PLACE.match(message)
    if lead is not None and (lead.group() == field or lead.group().startswith((field + ".", field + "["))):
        message = place(lead.group()) + message[lead.end():]
    return InvalidRequestError(message, param=place(exc.param) if exc.param else None, code=exc.code,
                               field=field)


async def serve_api(pump: Pump, api: WireAPI, scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI handler of one of `api`'s endpoints (its entry in the route table, `_routes.wire`)."""
    app = pump.app
    settings = app.settings
    cors = scope_cors(scope, settings.cors_origins)
    if scope["method"] == "OPTIONS":
        await send_response(send, 204, b"", [(b"allow", b"POST, OPTIONS"), *cors])
        return
    rid = new_id(api.id_prefix)
    rec = RequestRecord(request_id(scope, rid), scope["path"], trio.current_time())
    scope[REQUEST_ID] = rec.request_id
    extra = [(b"x-request-id", rec.request_id.encode()), *cors]
    stream: RequestStream | None = None
    gen: ApiCall | None = None
    body = b""
    adapter: str | None = None
    try:
        call = await read_json_request(scope, receive, app, api.parse, accept_x_api_key=api.accept_x_api_key)
        adapter = pick_adapter(settings, call.model)
        options = getattr(call, "options", None)  # a generating call's (`ApiCall`), built from its request
        if adapter is not None and isinstance(options, GenerationOptions):
            cast(Any, call).options = dataclasses.replace(options, adapter=adapter)
        async with app.engine_for(call.model) as engine:
            if hasattr(call, "respond"):
                body = await cast(ImmediateCall, call).respond(engine)
            else:
                gen = cast(ApiCall, call)
                rec.stream = gen.stream
                stream = await unless_disconnected(receive, partial(gen.start, engine), RequestStream.close)
    except Disconnected:
        rec.outcome = "disconnect"
        app.observe(rec)
        return
    except Exception as exc:
        await refuse(app, scope, send, exc, rec, extra, api.error_body)
        return
    if stream is None or gen is None:  # answered without generating
        rec.status, rec.ended = 200, trio.current_time()
        app.observe(rec)
        await send_response(send, 200, body, [*JSON_HEADERS, *extra])
        return
    rec.admitted = trio.current_time()
    rec.prompt_tokens = len(stream.prompt_tokens)
    model = answered_as(settings, adapter, call.model)
    if gen.stream:
        enc = gen.encoder(rid, model, rec.prompt_tokens, lambda: stream.cached_tokens)
        await pump.serve_stream(receive, send, [stream], enc, rec, extra)
        return
    whole = gen.whole

    def build(results: Sequence[ChoiceResult]) -> bytes:
        return whole(rid, model, results[0])

    try:
        await pump.serve_whole(receive, send, [stream], rec, extra, build, render=api.error_body)
    except Exception:
        log.exception("request %s failed", rec.request_id)
        rec.status, rec.outcome = 500, "failed"
        app.observe(rec)
        await send_error(send, HTTPError(500, "internal server error", type="server_error",
                                         code="internal_error"), extra, api.error_body)
