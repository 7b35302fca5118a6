"""Small raw-ASGI helpers for the endpoints served outside Quart's request machinery.

The completion endpoints talk ASGI directly (see `_pump.py`): reading
the body under a size limit, API-key and CORS checks, and sending a whole
JSON response. The same checks serve Quart's routes (`_app.py`), so both
paths answer alike.
"""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import trio

from .._errors import TrioMLXError
from ._http import HTTPError

T = TypeVar("T")

log = logging.getLogger("trio_mlx.http")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
RawHeaders = list[tuple[bytes, bytes]]

# How long a client may take to send its request body, unless told (the body_timeout setting).
BODY_TIMEOUT = 20.0
JSON_HEADERS: RawHeaders = [(b"content-type", b"application/json")]
CORS_ALLOW_HEADERS = (b"authorization, content-type, x-request-id, openai-organization, openai-project, "
                      b"x-api-key, anthropic-version, anthropic-beta")
CORS_MAX_AGE = b"600"
# What a page's script may read of an answer: the retry advice the SDKs follow, the request's id.
CORS_EXPOSE_HEADERS = b"retry-after, x-should-retry, x-request-id"
_HEADER_NAME = re.compile(rb"[A-Za-z0-9!#$%&'*+.^_`|~-]+")


# Where a request's id (the X-Request-Id response header) is kept in the ASGI scope, so that
# an access-log line written without response headers still carries it (`_logs.py`).
REQUEST_ID = "trio_mlx.request_id"


class Disconnected(TrioMLXError):
    """The client went away before its request was answered."""


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def request_id(scope: Scope, default: str) -> str:
    """The client's X-Request-Id when it is short printable ASCII, else `default`."""
    given = header(scope, b"x-request-id")
    if given and len(given) <= 128 and given.isascii() and given.decode().isprintable():
        return given.decode()
    return default


def _matching(given: str, api_key: str) -> str | None:
    """Which of the configured keys (`api_key`: one, or several separated by commas) `given`
    is, if any; each compared in constant time, and all of them whatever matched."""
    found = None
    for key in api_key.split(","):
        if (key := key.strip()) and hmac.compare_digest(given.strip().encode(), key.encode()):
            found = key
    return found


# Paths outside `/v1/` that change what the server holds: the API key guards them too.
ADMIN_PATHS = frozenset({"/models/unload"})


def needs_key(path: str) -> bool:
    """Whether a request to `path` must carry the API key (when the server has one): the API's
    paths under `/v1/` and `ADMIN_PATHS`, not the probes, the metrics or the pages."""
    return path.startswith("/v1/") or path in ADMIN_PATHS


def check_api_key(authorization: str | bytes | None, api_key: str | None, *,
                  x_api_key: str | bytes | None = None, accept_x_api_key: bool = False) -> str | None:
    """Raise 401 unless `Authorization: Bearer <key>` names a configured key (when any is
    configured: `api_key`, several separated by commas); returns the key (None: no keys).

    With `accept_x_api_key` (Anthropic's API, whose clients send the key that
    way), `x-api-key: <key>` (the header's value as `x_api_key`) does too.
    """
    if not api_key:
        return None
    if accept_x_api_key and x_api_key is not None:
        if isinstance(x_api_key, bytes):
            x_api_key = x_api_key.decode("latin-1")
        if (found := _matching(x_api_key, api_key)) is not None:
            return found
    if isinstance(authorization, bytes):
        authorization = authorization.decode("latin-1")
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and (found := _matching(token, api_key)) is not None:
        return found
    raise HTTPError(
        401,
        "a valid API key is required: send 'Authorization: Bearer <key>'"
        + (" or 'x-api-key: <key>'" if accept_x_api_key else ""),
        code="invalid_api_key",
        headers=[("WWW-Authenticate", "Bearer")],
    )


def cors_headers(origin: str | bytes | None, allowed: Sequence[str], *, preflight: bool = False,
                 requested: str | bytes | None = None) -> RawHeaders:
    """CORS response headers for `origin`, or none when it is not allowed. A preflight of an
    allowed origin allows the headers it asks for (`requested`: its
    Access-Control-Request-Headers), as Starlette's `allow_headers=["*"]` does: the SDKs send
    headers of their own on every request (openai-node's `x-stainless-*`, the anthropic SDK's
    `anthropic-dangerous-direct-browser-access`), and a fixed list failed their preflights."""
    if not origin or not allowed:
        return []
    if isinstance(origin, bytes):
        origin = origin.decode("latin-1")
    if "*" in allowed:
        out = [(b"access-control-allow-origin", b"*")]
    elif origin in allowed:
        out = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
    else:
        return []
    if preflight:
        if isinstance(requested, str):
            requested = requested.encode("latin-1", "replace")
        asked = [h.strip() for h in (requested or b"").split(b",")]
        names = b", ".join(h for h in asked if _HEADER_NAME.fullmatch(h))  # header names only, echoed
        out += [
            (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
            (b"access-control-allow-headers", CORS_ALLOW_HEADERS + (b", " + names if names else b"")),
            (b"access-control-max-age", CORS_MAX_AGE),
        ]
    else:
        out.append((b"access-control-expose-headers", CORS_EXPOSE_HEADERS))
    return out


def scope_cors(scope: Scope, allowed: Sequence[str]) -> RawHeaders:
    """`cors_headers` for an ASGI request (an OPTIONS request is a preflight)."""
    return cors_headers(header(scope, b"origin"), allowed, preflight=scope["method"] == "OPTIONS",
                        requested=header(scope, b"access-control-request-headers"))


def encode_headers(headers: Iterable[tuple[str, str]]) -> RawHeaders:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]


async def read_body(scope: Scope, receive: Receive, limit: int, seconds: float = BODY_TIMEOUT) -> bytes:
    """The whole request body; 413 past `limit` bytes, 408 if it takes over `seconds`."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    with trio.move_on_after(seconds) as timer:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Disconnected
            data = message.get("body", b"")
            size += len(data)
            if size > limit:
                raise _too_large(limit)
            chunks.append(data)
            if not message.get("more_body", False):
                break
    if timer.cancelled_caught:
        raise HTTPError(408, "the request body took too long to arrive", code="request_timeout",
                        headers=[("Connection", "close")])
    return b"".join(chunks)


# How much of a refused request's body `drain_body` reads, and for how long. Arbitrary:
# enough for any body a client pipelines another request behind.
DRAIN_BYTES = 1 << 20
DRAIN_SECONDS = 2.0


async def drain_body(receive: Receive) -> None:
    """Read and drop the request body (up to DRAIN_BYTES, for up to DRAIN_SECONDS), before
    an answer that closes the connection.

    Hypercorn 0.18 feeds the client's bytes to h11 while the app answers. Once a response
    saying `Connection: close` has gone out, h11 takes any byte after the request's end as
    an error ("Got data when expecting EOF"), and hypercorn then closes the socket at
    once, while the response is still being written: the app's send fails with
    trio.BusyResourceError (logged with a traceback) and the client gets nothing. A
    request with both Content-Length and Transfer-Encoding and another request pipelined
    behind it did exactly that. With the body read first, h11 has reached the request's
    end and waits (its PAUSED) until the answer is out, and only then meets the rest."""
    size = 0
    with trio.move_on_after(DRAIN_SECONDS):
        while size <= DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            size += len(message.get("body", b""))


def _too_large(limit: int) -> HTTPError:
    return HTTPError(413, f"the request body is larger than {limit} bytes", code="request_too_large",
                     headers=[("Connection", "close")])


async def send_response(send: Send, status: int, body: bytes, headers: RawHeaders) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def log_refusal(error: HTTPError, request_id: str | None) -> None:
    """One log line for a request the server refused, with its reason and request id: a 4xx is
    otherwise only an access line, and the client's side of it may be hidden (an agent's UI)."""
    message = error.message if len(error.message) <= 300 else error.message[:300] + "..."
    log.info("request %s refused: %d %s: %s", request_id or "-", error.status, error.code or error.type, message)


async def send_error(send: Send, error: HTTPError, extra: RawHeaders,
                     render: Callable[[HTTPError], bytes] | None = None) -> None:
    """`error` as a whole response, logged (`log_refusal`); `render` makes another API's body
    (default: OpenAI's)."""
    rid = next((v.decode("latin-1") for k, v in extra if k.lower() == b"x-request-id"), None)
    log_refusal(error, rid)
    body = error.body() if render is None else render(error)
    await send_response(send, error.status, body, [*JSON_HEADERS, *encode_headers(error.headers), *extra])


async def unless_disconnected(receive: Receive, start: Callable[[], Awaitable[T]],
                              discard: Callable[[T], object]) -> T:
    """`await start()` (the body is already read), cancelled if the client goes away
    meanwhile: then Disconnected, and what `start` returned, if it did, goes to
    `discard`. A request's admission can take long (its grammar's check, a long
    prompt's tokenizing); one whose client left is not worth finishing."""
    gone = False
    done: list[T] = []
    failed: list[Exception] = []  # raised out of the nursery, it would come wrapped in a group

    def left() -> None:
        nonlocal gone
        gone = True
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_disconnect, receive, left)
        try:
            done.append(await start())
        except Exception as exc:
            failed.append(exc)
        nursery.cancel_scope.cancel()
    if gone:
        for value in done:
            discard(value)
        raise Disconnected("the client went away while its request was admitted")
    if failed:
        raise failed[0]
    return done[0]


async def wait_disconnect(receive: Receive, on_disconnect: Callable[[], object]) -> None:
    """Call `on_disconnect` when the client goes away (the request body is already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return
