"""What the completion handlers, metrics and access logs share: the endpoints' paths, the
record of one completion request, and what a handler needs from the app (`ServerHost`), so
that none of them imports the app module (which imports all of them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    from ..engine import Engine, ModelPool
    from ._settings import Settings


class ServerHost(Protocol):
    """The app, as handlers and metrics see it (`TrioMLXApp` is the one implementation)."""

    settings: Settings
    nursery: Any  # trio.Nursery, open from lifespan startup to shutdown
    engine: Engine | None
    pool: ModelPool | None  # with --models; `engine` is None then

    def observe(self, rec: RequestRecord) -> None: ...
    def ready_engine(self) -> Engine: ...
    def engine_for(self, model: str | None) -> AbstractAsyncContextManager[Engine]: ...
    def open_streams(self) -> int: ...


CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MESSAGES_PATH = "/v1/messages"  # Anthropic's Messages API (server/anthropic/)
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
RESPONSES_PATH = "/v1/responses"  # OpenAI's Responses API (server/responses/)


@dataclass(slots=True)
class RequestRecord:
    """One completion request, as observers see it when it ends (times: trio.current_time())."""

    request_id: str
    endpoint: str
    arrived: float
    stream: bool = False
    n: int = 1
    status: int = 0
    admitted: float | None = None
    first_token: float | None = None
    ended: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, from the prompt cache
    completion_tokens: int = 0
    finish_reasons: tuple[str, ...] = ()
    # "ok", "error" (4xx/5xx before streaming), "disconnect", "stall", "cancelled",
    # "aborted" (ended by shutdown), "failed" (the engine or the server failed mid-way)
    outcome: str = "ok"
