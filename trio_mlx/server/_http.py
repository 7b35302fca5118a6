"""What every API of the server shares at the HTTP level: errors, JSON and ids.

`HTTPError` is every error response the server sends, in OpenAI's shape by default
({"error": {message, type, param, code}}; another API renders it in its own,
`_wire.WireAPI.error_body`), and library exceptions become HTTP errors in one place,
`error_from_exception`. JSON goes through orjson (`dumps`, `loads`, `parse_json` for a
request body); `new_id` makes response and request ids.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from .._errors import (
    EngineBrokenError,
    EngineClosedError,
    InvalidRequestError,
    ModelBusyError,
    ModelCapacityError,
    ModelLoadError,
    ModelLoadTimeoutError,
    QueueFullError,
    TrioMLXError,
)

try:
    import orjson

    dumps = orjson.dumps
    _JSONDecodeError: tuple[type[BaseException], ...] = (orjson.JSONDecodeError, RecursionError)

    def loads(data: bytes) -> Any:
        return orjson.loads(data)

except ImportError:  # pragma: no cover - orjson is a dependency; this keeps the module importable
    _encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)

    def dumps(obj: Any) -> bytes:  # type: ignore[misc]
        return _encoder.encode(obj).encode()

    _JSONDecodeError = (ValueError, RecursionError)

    def loads(data: bytes) -> Any:
        return json.loads(data.decode("utf-8"))



class HTTPError(TrioMLXError):
    """An OpenAI-shaped error response: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Sequence[tuple[str, str]] = (),
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        if status in (401, 403) and not any(k.lower() == "x-should-retry" for k, _ in headers):
            # Anthropic's and OpenAI's SDKs retry a refusal unless told not to: a wrong key was
            # retried 11 times over ~3 minutes by Claude Code before it said anything.
            headers = (*headers, ("x-should-retry", "false"))
        self.headers = tuple(headers)

    def payload(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body(self) -> bytes:
        return dumps(self.payload())


def error_from_exception(exc: BaseException) -> HTTPError:
    """Map a library exception onto its HTTP error (the one place this happens)."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return HTTPError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, QueueFullError):
        retry = str(max(1, round(exc.retry_after)))
        return HTTPError(429, str(exc), type="rate_limit_error", code="queue_full", headers=[("Retry-After", retry)])
    if isinstance(exc, ModelCapacityError):  # several models, every loaded one busy (`engine/_pool.py`)
        retry = str(max(1, round(exc.retry_after)))
        return HTTPError(503, str(exc), type="server_error", code="model_capacity",
                         headers=[("Retry-After", retry)])
    if isinstance(exc, ModelBusyError):  # an unload asked of a model that serves (`engine/_pool.py`)
        return HTTPError(409, str(exc), code="model_busy")
    if isinstance(exc, ModelLoadTimeoutError):  # a load on demand past startup_timeout (`engine/_pool.py`):
        # 503, not 500: the server is sound and the model may load on a later try (a slow download,
        # the GPU thread busy), and the SDKs that retry 503s then retry after Retry-After
        retry = str(max(1, round(exc.retry_after)))
        return HTTPError(503, str(exc), type="server_error", code="model_load_timeout",
                         headers=[("Retry-After", retry)])
    if isinstance(exc, ModelLoadError):  # a model of several, loaded for this request, failed
        return HTTPError(500, str(exc), type="server_error", code="model_load_failed")
    if isinstance(exc, EngineBrokenError):
        return HTTPError(503, "the model failed and the server is not serving; it needs a restart",
                         type="server_error", code="engine_broken")
    if isinstance(exc, EngineClosedError):
        return unavailable(str(exc))
    if isinstance(exc, ValidationError):
        return _validation_error(exc)
    return HTTPError(500, "internal server error", type="server_error", code="internal_error")


def unavailable(message: str, retry_after: int = 5) -> HTTPError:
    return HTTPError(503, message, type="server_error", code="service_unavailable",
                     headers=[("Retry-After", str(retry_after))])


def _validation_error(exc: ValidationError) -> HTTPError:
    # Of a union's failed branches, the deepest location is the most telling one.
    err = max(exc.errors(include_url=False), key=lambda e: len(e["loc"]))
    # Drop the union-member names pydantic puts in locations ("str", "list[int]").
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES))]
    param = ".".join(loc) or None
    msg = err["msg"]
    if err["type"] == "value_error":
        msg = msg.removeprefix("Value error, ")
    return HTTPError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


# The deepest nesting of arrays and objects a request body may have. orjson parses up to 1024
# levels but writes at most 254, and the server writes parts of a request back (a tool call's
# input into the prompt, a tool's parameters into a response): a body it parses must be one
# it can write, or a request fails with a 500 after it was taken (or a stream is cut short).
# No real request comes near: the deepest JSON schemas agents send nest a few dozen levels.
MAX_JSON_DEPTH = 128


def parse_json(body: bytes) -> Any:
    try:
        obj = loads(body)
    except UnicodeDecodeError:
        raise HTTPError(400, "the request body is not valid UTF-8", code="invalid_json") from None
    except _JSONDecodeError as exc:
        raise HTTPError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if too_deep(obj, MAX_JSON_DEPTH):
        raise HTTPError(400, f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep",
                        code="invalid_json")
    return obj


def too_deep(obj: Any, most: int) -> bool:
    """Whether `obj` (parsed JSON) nests lists and dicts more than `most` levels deep: a walk
    over its containers alone, with a stack, not recursion."""
    stack = [(obj, 1)] if isinstance(obj, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > most:
            return True
        for v in node.values() if isinstance(node, dict) else node:
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1))
    return False


def new_id(prefix: str) -> str:
    return prefix + os.urandom(12).hex()


def now() -> int:
    return int(time.time())
