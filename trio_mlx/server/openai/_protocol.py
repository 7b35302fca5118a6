"""OpenAI's request models: Chat Completions and (legacy) Completions.

The pydantic models validate requests and document them (/openapi.json). Each
checks its API's documented ranges and builds the engine's one `GenerationOptions`
record in one method, `to_options()`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from ...engine import GenerationOptions
from .._http import HTTPError

# ---- request models ----------------------------------------------------------


class _Strict(BaseModel):
    # Unknown fields are ignored (clients send many); types are checked strictly.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


def _null_is(default: Any, schema: dict[str, Any]) -> tuple[Any, ...]:
    """A field's metadata for an explicit null meaning `default`, as OpenAI takes it (the SDKs
    send null for a parameter given as None), and the API's document saying it takes null;
    its Python type stays plain."""
    return (BeforeValidator(lambda value: default if value is None else value),
            WithJsonSchema({"anyOf": [schema, {"type": "null"}]}))


_FalseIfNull = Annotated[bool, *_null_is(False, {"type": "boolean"})]
_TrueIfNull = Annotated[bool, *_null_is(True, {"type": "boolean"})]
_OneIfNull = Annotated[int, Field(ge=1), *_null_is(1, {"type": "integer", "minimum": 1})]
# completions' max_tokens: OpenAI's 16 for null too, not the server's default length
_SixteenIfNull = Annotated[int, Field(ge=1), *_null_is(16, {"type": "integer", "minimum": 1})]


class ContentPart(_Strict):
    type: str
    text: str | None = None
    refusal: str | None = Field(None, description="a refusal part's text (an assistant message's)")

    @field_validator("type")
    @classmethod
    def _known(cls, value: str) -> str:
        # Media parts pass to the engine, which refuses them in the user's last turn and notes
        # them elsewhere (the models served read text only: engine/_text.py).
        if value not in ("text", "image_url", "input_audio", "file", "refusal"):
            raise ValueError(f"content parts may be text, image_url, input_audio, file or (an assistant's) "
                             f"refusal, got type {value!r}")
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

    @model_validator(mode="after")
    def _refusals_are_the_assistants(self) -> ChatMessage:
        if isinstance(self.content, list) and any(p.type == "refusal" for p in self.content):
            if self.role != "assistant":
                raise ValueError("a refusal content part belongs to an assistant message")
            # the model reads a refusal it made as what it said
            self.content = [ContentPart(type="text", text=p.refusal or "", refusal=None) if p.type == "refusal" else p
                            for p in self.content]
        return self

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
    n: _OneIfNull = 1
    stream: _FalseIfNull = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: _FalseIfNull = False
    cache_salt: str | None = Field(None, description="vLLM's: the prompt cache is shared only among "
                                   "requests of the same salt, so cached_tokens reveal no other user's prompt")

    def _shared_options(self) -> dict[str, Any]:
        """The `GenerationOptions` fields both endpoints take alike, by the record's names."""
        return dict(
            temperature=self.temperature, top_p=self.top_p,
            top_k=None if self.top_k is None else max(self.top_k, 0),  # -1 (vLLM's "off") overrides a default
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias or None,  # the engine checks the ids
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            cache_salt=self.cache_salt,
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
    logprobs: _FalseIfNull = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = Field(
        None, description='functions the model may call: [{"type": "function", "function": {"name", '
        '"description", "parameters"}}], rendered through the model\'s chat template')
    tool_choice: Any = Field(
        None, description='"auto" (the default with tools), "none", "required", or {"type": "function", '
        '"function": {"name": ...}}; "required" and a named function are enforced by constrained decoding')
    parallel_tool_calls: _TrueIfNull = Field(True, description="false: at most one call, where a call is enforced")
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
        '"json_schema": {"name", "schema", "strict"}}: enforced token by token')
    continue_final_message: _FalseIfNull = Field(
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
    max_tokens: _SixteenIfNull = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: _FalseIfNull = False
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
