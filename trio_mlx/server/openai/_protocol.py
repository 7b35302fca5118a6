"""The OpenAI wire format: request models, response and SSE chunk builders, error bodies.

The pydantic models validate requests and document them (/openapi.json);
the builders turn engine events into bytes. Streamed chunks are cut from
byte templates made once per request around one json-escaped string, never
built through pydantic or nested dicts: that code runs once per SSE event on
the event loop, which shares the GIL with the GPU actor (docs/design.md, rule 7).
Every error body the server sends is made by `HTTPError` here, and library
exceptions become HTTP errors in one place, `error_from_exception`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..._errors import (
    EngineBrokenError,
    EngineClosedError,
    InvalidRequestError,
    QueueFullError,
    TrioMLXError,
)
from ...engine import Finished, GenerationOptions, TokenLogprob, ToolCall, ToolCallDelta, Usage

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


DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
# OpenAI reports the log-probability of impossible tokens as -9999.0; JSON has no -Infinity.
_LOGPROB_FLOOR = -9999.0


# ---- errors ------------------------------------------------------------------


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

    def sse(self) -> bytes:
        """The error as the last event of a stream that already started, then [DONE]."""
        return b"data: " + self.body() + b"\n\n" + DONE


def error_from_exception(exc: BaseException) -> HTTPError:
    """Map a library exception onto its HTTP error (the one place this happens)."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return HTTPError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, QueueFullError):
        retry = str(max(1, round(exc.retry_after)))
        return HTTPError(429, str(exc), type="rate_limit_error", code="queue_full", headers=[("Retry-After", retry)])
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


def parse_json(body: bytes) -> Any:
    try:
        return loads(body)
    except UnicodeDecodeError:
        raise HTTPError(400, "the request body is not valid UTF-8", code="invalid_json") from None
    except _JSONDecodeError as exc:
        raise HTTPError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None


# ---- request models ----------------------------------------------------------


class _Strict(BaseModel):
    # Unknown fields are ignored (clients send many); types are checked strictly.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: str
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _known(cls, value: str) -> str:
        # Media parts pass to the engine, which refuses them in the user's last turn and notes
        # them elsewhere (the models served read text only: engine/_text.py).
        if value not in ("text", "image_url", "input_audio", "file"):
            raise ValueError(f"content parts may be text, image_url, input_audio or file, got type {value!r}")
        return value


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any] = Field(
        "{}", description="the call's arguments: a JSON object as text (OpenAI's form), or the object")


class MessageToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, description="an assistant message's calls")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")

    def template_dict(self) -> dict[str, Any]:
        content: Any = self.content
        if isinstance(content, list):
            if all(part.type == "text" for part in content):
                content = "".join(part.text or "" for part in content)
            else:  # media parts go on as parts: the engine refuses or notes them
                content = [{"type": part.type, "text": part.text or ""} for part in content]
        # "developer" is OpenAI's newer name for "system"; chat templates know "system".
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:  # arguments stay JSON text here; the engine parses them for the template
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class _Sampling(_Strict):
    model: str | None = Field(None, description="the served model id; absent: the served model")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1: no top-k")
    min_p: float | None = Field(None, ge=0, le=1)
    # The range the engine samples with (documented as (0, 100], which refused (0, 0.001) later on).
    repetition_penalty: float | None = Field(None, ge=0.001, le=100)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    seed: int | None = Field(None, description="with n > 1, choice i uses seed + i")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False

    def _shared_options(self) -> dict[str, Any]:
        """The `GenerationOptions` fields both endpoints take alike, by the record's names."""
        return dict(
            temperature=self.temperature, top_p=self.top_p,
            top_k=None if self.top_k is None else max(self.top_k, 0),  # -1 (vLLM's "off") overrides a default
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias or None,  # the engine checks the ids
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _check_common(self, max_n: int) -> None:
        if self.n > max_n:
            raise HTTPError(400, f"n must be at most {max_n}", param="n", code="invalid_value")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="an alias of max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = Field(
        None, description='functions the model may call: [{"type": "function", "function": {"name", '
        '"description", "parameters"}}], rendered through the model\'s chat template')
    tool_choice: Any = Field(
        None, description='"auto" (the default with tools), "none", "required", or {"type": "function", '
        '"function": {"name": ...}}; "required" and a named function are enforced by constrained decoding')
    parallel_tool_calls: bool = Field(True, description="false: at most one call, where a call is enforced")
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
        '"json_schema": {"name", "schema", "strict"}}: enforced token by token')
    continue_final_message: bool = Field(
        False, description="an extension (vLLM's): continue the last message, the assistant's, rather than "
        "answer it (a prefill); the reply holds only the continuation")
    # Accepted only in their no-op forms; anything else changes semantics -> 400.
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None

    def check(self, max_n: int) -> None:
        self._check_common(max_n)
        if self.functions:
            raise _unsupported("functions", "the deprecated functions are not supported; send tools")
        if self.function_call not in (None, "none"):
            raise _unsupported("function_call", "the deprecated function_call is not supported; send tool_choice")
        if self.audio is not None or (self.modalities and set(self.modalities) != {"text"}):
            raise _unsupported("modalities", "only text output is supported")
        if self.prediction is not None:
            raise _unsupported("prediction", "predicted outputs are not supported by this server")
        if self.top_logprobs and not self.logprobs:
            raise HTTPError(400, "top_logprobs requires logprobs to be true", param="top_logprobs",
                            code="invalid_value")

    def to_options(self) -> GenerationOptions:
        """The engine's options for this request: every field is read here, once."""
        return GenerationOptions(
            **self._shared_options(),
            max_tokens=self.max_tokens if self.max_tokens is not None else self.max_completion_tokens,
            logprobs=self.logprobs, top_logprobs=(self.top_logprobs or 0) if self.logprobs else 0,
            response_format=self.response_format, tools=self.tools, tool_choice=self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls, continue_final_message=self.continue_final_message,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of one string, or token ids (a list of ints, or a list of one)")
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = Field(
        None, description='as on chat completions: {"type": "json_object"} or {"type": "json_schema", ...}')

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_forms(cls, value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(_PROMPT_FORMS) from None

    def check(self, max_n: int) -> None:
        self._check_common(max_n)
        if self.echo:
            raise _unsupported("echo", "echo is not supported by this server")
        if self.suffix:
            raise _unsupported("suffix", "suffix (insertion) is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise _unsupported("best_of", "best_of other than n is not supported by this server")
        prompt = self.prompt
        if isinstance(prompt, list) and (len(prompt) == 0 or (not isinstance(prompt[0], int) and len(prompt) != 1)):
            raise HTTPError(400, _PROMPT_FORMS + " (send one request per prompt)", param="prompt",
                            code="invalid_value")

    def engine_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        first = prompt[0]
        if isinstance(first, int):
            return prompt  # type: ignore[return-value]
        return first  # type: ignore[return-value]

    def to_options(self) -> GenerationOptions:
        """The engine's options for this request: every field is read here, once."""
        return GenerationOptions(
            **self._shared_options(), max_tokens=self.max_tokens,
            # logprobs is how many alternatives, so 0 asks for the chosen tokens' own
            logprobs=self.logprobs is not None, top_logprobs=self.logprobs or 0,
            response_format=self.response_format,
        )


_PROMPT_FORMS = "prompt must be a string, a list of one string, or a list of token ids"


def _unsupported(param: str, message: str) -> HTTPError:
    return HTTPError(400, message, param=param, code="unsupported_parameter")


# ---- responses ---------------------------------------------------------------


def new_id(prefix: str) -> str:
    return prefix + os.urandom(12).hex()


def now() -> int:
    return int(time.time())


def usage_dict(usage: Usage) -> dict[str, Any]:
    return total_usage([usage])


def total_usage(usages: Sequence[Usage]) -> dict[str, Any]:
    """n choices share one prompt: it is counted once, completions are summed. Its
    `cached_tokens` (OpenAI's `prompt_tokens_details`) are the fewest any choice took from
    the prompt cache: the first choice's prompt is the one the others reuse."""
    prompt = usages[0].prompt_tokens if usages else 0
    completion = sum(u.completion_tokens for u in usages)
    cached = min((u.cached_tokens for u in usages), default=0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _lp(value: float) -> float:
    return value if value > _LOGPROB_FLOOR else _LOGPROB_FLOOR  # also maps NaN and -inf


def chat_logprobs(items: Sequence[TokenLogprob]) -> dict[str, Any]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**entry(t.token, t.logprob), "top_logprobs": [entry(s, lp) for _, s, lp in t.top]}
            for t in items
        ],
        "refusal": None,
    }


def completion_logprobs(items: Sequence[TokenLogprob], offset: int = 0) -> tuple[dict[str, Any], int]:
    """The legacy format; returns it with the text offset after the last token."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for t in items:
        tokens.append(t.token)
        token_lps.append(_lp(t.logprob))
        tops.append({s: _lp(lp) for _, s, lp in t.top})
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


class ChoiceResult:
    """What one choice of a non-streamed request accumulated."""

    __slots__ = ("text", "reasoning", "logprobs", "tool_calls", "finished")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.tool_calls: list[ToolCall] = []
        self.finished: Finished | None = None


def chat_response(rid: str, created: int, model: str, choices: Sequence[ChoiceResult], logprobs: bool) -> bytes:
    out = []
    for i, c in enumerate(choices):
        assert c.finished is not None
        content = "".join(c.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if c.reasoning:
            message["reasoning_content"] = "".join(c.reasoning)
        if c.tool_calls:
            message["content"] = content or None  # OpenAI's shape for a reply that is only calls
            message["tool_calls"] = [tool_call_dict(t) for t in c.tool_calls]
        out.append({
            "index": i,
            "message": message,
            "logprobs": chat_logprobs(c.logprobs) if logprobs else None,
            "finish_reason": c.finished.finish_reason,
        })
    return dumps({
        "id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
        "usage": total_usage([c.finished.usage for c in choices if c.finished is not None]),
    })


def tool_call_dict(call: ToolCall, *, index: bool = False) -> dict[str, Any]:
    """One entry of `message.tool_calls` (with `index`: of a stream's `delta.tool_calls`)."""
    out: dict[str, Any] = {"index": call.index} if index else {}
    out.update(id=call.id, type="function", function={"name": call.name, "arguments": call.arguments})
    return out


def completion_response(rid: str, created: int, model: str, choices: Sequence[ChoiceResult], logprobs: bool) -> bytes:
    out = []
    for i, c in enumerate(choices):
        assert c.finished is not None
        out.append({
            "index": i,
            "text": "".join(c.text),
            "logprobs": completion_logprobs(c.logprobs)[0] if logprobs else None,
            "finish_reason": c.finished.finish_reason,
        })
    return dumps({
        "id": rid, "object": "text_completion", "created": created, "model": model, "choices": out,
        "usage": total_usage([c.finished.usage for c in choices if c.finished is not None]),
    })


class ChunkTemplates:
    """The bytes of one streamed request's SSE events, precomputed per choice.

    `delta(i, text)` is the hot path: two byte concatenations around the
    json-escaped text. Chunks with logprobs, finish and usage chunks are rarer
    and built from dicts.
    """

    __slots__ = ("chat", "head", "include_usage", "_plain", "_first", "_suffix", "_offsets")

    def __init__(self, *, chat: bool, rid: str, created: int, model: str, n: int, include_usage: bool):
        self.chat = chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        self.head: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model}
        head = b"data: " + dumps(self.head)[:-1] + b',"choices":[{"index":'
        self.include_usage = include_usage  # OpenAI sends "usage": null on every chunk but the last
        tail = b',"usage":null}\n\n' if include_usage else b"}\n\n"
        if chat:
            self._plain = [head + b'%d,"delta":{"content":' % i for i in range(n)]
            self._first = [head + b'%d,"delta":{"role":"assistant","content":' % i for i in range(n)]
            self._suffix = b'},"logprobs":null,"finish_reason":null}]' + tail
        else:
            self._plain = self._first = [head + b'%d,"text":' % i for i in range(n)]
            self._suffix = b',"logprobs":null,"finish_reason":null}]' + tail
        self._offsets = [0] * n

    def delta(self, index: int, text: str, first: bool) -> bytes:
        return (self._first if first else self._plain)[index] + dumps(text) + self._suffix

    def delta_logprobs(self, index: int, text: str, first: bool, items: Sequence[TokenLogprob]) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(items), "finish_reason": None}
        else:
            lps, self._offsets[index] = completion_logprobs(items, self._offsets[index])
            choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": None}
        return self._event({"choices": [choice]})

    def tool_calls(self, index: int, calls: Sequence[ToolCall], first: bool) -> bytes:
        """Finished calls, whole: id, name and all the arguments in one `delta.tool_calls`
        chunk (OpenAI's clients accept that as they accept fragments), for families
        whose calls do not stream as `ToolCallDelta`s."""
        delta: dict[str, Any] = {"role": "assistant", "content": None} if first else {}
        delta["tool_calls"] = [tool_call_dict(c, index=True) for c in calls]
        return self._event({"choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]})

    def tool_call_delta(self, index: int, d: ToolCallDelta, first: bool, opening: bool) -> bytes:
        """A streamed call's piece, as vLLM and llama-server send it: its `opening` chunk
        has index, id, type, function.name and arguments ""; the others only index and
        an arguments fragment (clients join them by index)."""
        delta: dict[str, Any] = {"role": "assistant", "content": None} if first else {}
        if opening:
            entry: dict[str, Any] = {"index": d.index, "id": d.id, "type": "function",
                                     "function": {"name": d.name, "arguments": d.arguments}}
        else:
            entry = {"index": d.index, "function": {"arguments": d.arguments}}
        delta["tool_calls"] = [entry]
        return self._event({"choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]})

    def reasoning(self, index: int, text: str, first: bool) -> bytes:
        """Reasoning text, as `delta.reasoning_content` (vLLM's and mlx_lm.server's field)."""
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        delta["reasoning_content"] = text
        return self._event({"choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]})

    def finish(self, index: int, reason: str, role_sent: bool) -> bytes:
        if self.chat:
            delta = {} if role_sent else {"role": "assistant", "content": ""}
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": "", "logprobs": None, "finish_reason": reason}
        return self._event({"choices": [choice]})

    def usage(self, usages: Sequence[Usage]) -> bytes:
        return b"data: " + dumps({**self.head, "choices": [], "usage": total_usage(usages)}) + b"\n\n"

    def _event(self, fields: dict[str, Any]) -> bytes:
        if self.include_usage:
            fields["usage"] = None
        return b"data: " + dumps({**self.head, **fields}) + b"\n\n"
