"""The one error hierarchy of trio_mlx.

Every error the library raises derives from TrioMLXError. MLX and tokenizer
exceptions are mapped onto these at the actor / model-loading boundary; the
HTTP layer maps these onto OpenAI-shaped responses in one place.
"""

from __future__ import annotations

import re

# A param's leading name: the field it is about (`tools` of `tools[0].function.name`).
_FIELD = re.compile(r"\w+")


def _field(param: str | None) -> str | None:
    found = _FIELD.match(param) if param else None
    return found.group() if found else None


class TrioMLXError(Exception):
    """Base class of every error trio_mlx raises."""


class ModelLoadError(TrioMLXError):
    """The model could not be found, converted or loaded."""


class InvalidRequestError(TrioMLXError, ValueError):
    """A request's arguments are invalid; it never reached the actor.

    `param` says where, in the engine's names: a field of `GenerationOptions` (or `messages`,
    `prompt`), then the place inside it (`tools[0].function.name`). `field` is that field: the
    reference each wire API maps to its own parameter's name (`server/_wire.api_error`)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 field: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.field = field if field is not None else _field(param)


class ContextLengthExceededError(InvalidRequestError):
    """The prompt plus max_tokens does not fit in the model's context; `prompt_tokens` (at least
    that many, where counted from characters alone) and `context_length` when known."""

    def __init__(self, message: str, *, param: str | None = "messages", prompt_tokens: int | None = None,
                 context_length: int | None = None):
        super().__init__(message, param=param, code="context_length_exceeded")
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length


class QueueFullError(TrioMLXError):
    """Too many requests are waiting; this one was shed before reaching the actor."""

    def __init__(self, message: str, *, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class EngineClosedError(TrioMLXError):
    """The engine is closed or draining and takes no new requests."""


class EngineBrokenError(TrioMLXError):
    """The GPU actor died; the engine serves nothing more."""


class EngineRestartingError(EngineClosedError):
    """The GPU actor died and a new one is starting; retry shortly."""


class ModelLoadTimeoutError(ModelLoadError):
    """A model of several, loaded on demand, did not load within its time bound: its requests
    fail with this; retry after `retry_after` seconds (the load's own work may still be ending)."""

    def __init__(self, message: str, *, retry_after: float = 5.0):
        super().__init__(message)
        self.retry_after = retry_after


class ModelBusyError(TrioMLXError):
    """A model of several cannot be unloaded now: it has requests in flight or being admitted,
    or it is loading or unloading."""


class ModelCapacityError(TrioMLXError):
    """A model cannot be loaded now: as many models as allowed are loaded and none of them is
    idle, so none can be unloaded; retry after `retry_after` seconds."""

    def __init__(self, message: str, *, retry_after: float = 5.0):
        super().__init__(message)
        self.retry_after = retry_after
