"""Anthropic's Messages API on the wire: request models, their translation into OpenAI-shaped
chat messages and tools for `engine.chat`, and Anthropic's error body.

Field names follow the official `anthropic` SDK's types (`anthropic.types`):
`MessageCreateParams`, `MessageCountTokensParams`, `ToolParam`,
`ToolChoice*Param`, and the content blocks `text`, `tool_use`, `tool_result`.
The engine speaks OpenAI's chat shape (assistant `tool_calls` whose arguments
are JSON text, `role: "tool"` results with a `tool_call_id`, function tools),
so a request is translated once, here, before it reaches the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .._openai import HTTPError, dumps

# Anthropic's error types by HTTP status (docs.anthropic.com, "Errors").
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
    503: "overloaded_error", 529: "overloaded_error",
}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_payload(err: HTTPError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(err.status), "message": err.message}}


def error_body(err: HTTPError) -> bytes:
    """`{"type": "error", "error": {"type": ..., "message": ...}}`."""
    return dumps(error_payload(err))


class _Strict(BaseModel):
    # Unknown fields are ignored (clients send many: cache_control, metadata, ...); types are strict.
    model_config = ConfigDict(extra="ignore", strict=True)


class Block(_Strict):
    """One content block; which fields matter depends on `type` (checked in `chat_messages`)."""

    type: str
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool = False


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class SystemBlock(_Strict):
    type: Literal["text"]
    text: str


class Tool(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = Field(None, description="absent or 'custom'; Anthropic's server tools are not served")


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None


class _Conversation(_Strict):
    model: str = Field(description="the served model id")
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[SystemBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation in OpenAI's shape, for `engine.chat`."""
        return chat_messages(self.system, self.messages)

    def prefill(self) -> bool:
        """Whether the conversation ends with an assistant turn: Anthropic's prefill, which
        the answer continues (`engine.chat`'s continue_final_message). Checked as Anthropic
        checks it: text only, with no trailing whitespace."""
        last = self.messages[-1]
        if last.role != "assistant":
            return False
        param = f"messages.{len(self.messages) - 1}.content"
        blocks = [Block(type="text", text=last.content)] if isinstance(last.content, str) else last.content
        if any(b.type == "tool_use" for b in blocks):
            raise _bad(param, "a final assistant turn (a prefill) may hold text only, not tool_use")
        text = "".join(b.text or "" for b in blocks if b.type == "text")
        if text != text.rstrip():
            raise _bad(param, "final assistant content cannot end with trailing whitespace")
        return True

    def tool_options(self) -> dict[str, Any]:
        """`engine.chat`'s tools, tool_choice and parallel_tool_calls."""
        tools, choice = chat_tools(self.tools), chat_tool_choice(self.tool_choice, self.tools)
        if not tools:
            return {}
        out: dict[str, Any] = {"tools": tools}
        if choice is not None:
            out["tool_choice"] = choice
        if self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
        return out


class MessagesRequest(_Conversation):
    """`POST /v1/messages`."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="0: no top-k")
    stream: bool = False
    output_config: OutputConfig | None = Field(
        None, description="format: {type: json_schema, schema}: the answer is JSON valid against it")
    ignore_eos: bool = Field(False, description="an extension (as on the OpenAI endpoints): "
                                                "generate max_tokens tokens")

    def engine_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"max_tokens": self.max_tokens}
        if self.ignore_eos:
            opts["ignore_eos"] = True
        if self.stop_sequences:
            opts["stop"] = self.stop_sequences
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(self, name)
            if value is not None:
                opts[name] = value
        return opts

    def structure(self) -> dict[str, Any]:
        """`engine.chat`'s tools, tool_choice, parallel_tool_calls and response_format."""
        out = self.tool_options()
        fmt = self.output_config.format if self.output_config else None
        if fmt is not None:
            out["response_format"] = {"type": "json_schema",
                                      "json_schema": {"name": "output", "schema": fmt.schema_, "strict": True}}
        return out


class CountTokensRequest(_Conversation):
    """`POST /v1/messages/count_tokens`."""


def _bad(param: str, message: str) -> HTTPError:
    return HTTPError(400, f"{param}: {message}", param=param, code="invalid_value")


def _text(blocks: str | Sequence[Block | SystemBlock] | None, param: str) -> str:
    """The text of a string or a list of text blocks (blocks joined by a newline)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    texts = []
    for j, b in enumerate(blocks):
        if b.type != "text" or b.text is None:
            raise _bad(f"{param}.{j}", f"only text blocks are supported here, got type {b.type!r}")
        texts.append(b.text)
    return "\n".join(texts)


def chat_messages(system: str | list[SystemBlock] | None, messages: list[InputMessage]) -> list[dict[str, Any]]:
    """Anthropic's system and messages -> OpenAI-shaped chat messages.

    An assistant turn's `tool_use` blocks become its `tool_calls`; a user turn's
    `tool_result` blocks become `role: "tool"` messages, in block order around
    its text. Thinking blocks (a model's own earlier reasoning, sent back) are
    dropped; images and documents get a 400.
    """
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(messages):
        param = f"messages.{i}.content"
        blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            texts: list[str] = []
            calls: list[dict[str, Any]] = []
            for j, b in enumerate(blocks):
                if b.type == "text" and b.text is not None:
                    texts.append(b.text)
                elif b.type == "tool_use":
                    if not b.id or not b.name or b.input is None:
                        raise _bad(f"{param}.{j}", "a tool_use block needs id, name and input")
                    calls.append({"id": b.id, "type": "function",
                                  "function": {"name": b.name, "arguments": dumps(b.input).decode()}})
                elif b.type in ("thinking", "redacted_thinking"):
                    continue
                else:
                    raise _bad(f"{param}.{j}", f"an assistant turn may hold text and tool_use blocks, "
                                               f"got type {b.type!r}")
            msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        pending: list[str] = []
        for j, b in enumerate(blocks):
            if b.type == "text" and b.text is not None:
                pending.append(b.text)
            elif b.type == "tool_result":
                if not b.tool_use_id:
                    raise _bad(f"{param}.{j}", "a tool_result block needs tool_use_id")
                if pending:
                    out.append({"role": "user", "content": "\n".join(pending)})
                    pending = []
                result = _text(b.content, f"{param}.{j}.content")
                if b.is_error:
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": result})
            else:
                raise _bad(f"{param}.{j}", f"only text and tool_result blocks are supported in a user "
                                           f"turn, got type {b.type!r}")
        if pending or not blocks:
            out.append({"role": "user", "content": "\n".join(pending)})
    return out


def chat_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.type not in (None, "custom"):
            raise _bad(f"tools.{i}.type", f"Anthropic's server tools ({t.type!r}) are not served here; "
                                          "define client tools with name, description and input_schema")
        function: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            function["description"] = t.description
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: ToolChoice | None, tools: list[Tool] | None) -> Any:
    """auto -> "auto", any -> "required", tool -> the named function, none -> "none"."""
    if choice is None:
        return None
    if choice.type != "none" and not tools:
        raise _bad("tool_choice", f"tool_choice {choice.type!r} needs tools")
    if choice.type == "tool":
        if not choice.name:
            raise _bad("tool_choice.name", "tool_choice of type 'tool' needs the tool's name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]
