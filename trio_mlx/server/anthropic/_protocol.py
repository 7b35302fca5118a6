"""Anthropic's Messages API on the wire: request models, their translation into OpenAI-shaped
chat messages and tools for `engine.chat`, and Anthropic's error body.

Field names follow the official `anthropic` SDK's types (`anthropic.types`):
`MessageCreateParams`, `MessageCountTokensParams`, `ToolParam`,
`ToolChoice*Param`, and the content blocks `text`, `image`, `document`, `tool_use`,
`tool_result`.
The engine speaks OpenAI's chat shape (assistant `tool_calls` whose arguments
are JSON text, `role: "tool"` results with a `tool_call_id`, function tools),
so a request is translated once, here, before it reaches the engine.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ...engine import GenerationOptions
from ...engine._text import media_refusal
from .._http import HTTPError, dumps

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
    # image, document
    source: dict[str, Any] | None = None
    title: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool = False


class InputMessage(_Strict):
    # "system": a system turn inside the conversation (Claude Code's
    # mid-conversation-system beta), rendered where the chat template places it.
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class SystemBlock(_Strict):
    type: Literal["text"]
    text: str


class Tool(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = Field(None, description="absent or 'custom'; Anthropic's server tools are not served")

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, data: Any) -> Any:
        """A server tool (`web_search_20250305`, `bash_20250124`, ...) has no input_schema:
        said before the fields are checked, or its 400 would be that field's absence."""
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise ValueError(f"Anthropic's server tools ({data.get('type')!r}) are not served here; "
                             "define client tools with name, description and input_schema")
        return data


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

    def to_options(self) -> GenerationOptions:
        """The engine's options for this request: every field is read here, once (its tools
        and format translated into OpenAI's shapes, a 400 where they cannot be)."""
        # Anthropic's max_tokens is a ceiling, and clients send large ones (Claude Code asks
        # for tens of thousands whatever the conversation's length): where the prompt fits but
        # the ceiling does not, the answer runs to the context's end, as Anthropic's newer
        # models do (stop_reason "model_context_window_exceeded").
        structure, prefill = self.structure(), self.prefill()
        if prefill and ("response_format" in structure or structure.get("tool_choice") not in (None, "auto", "none")):
            # the engine refuses it too, in chat's names (`continue_final_message`, `response_format`)
            raise _bad("messages", "a final assistant turn (a prefill) cannot go with output_config.format or a "
                                   "tool_choice of 'any' or 'tool': the grammar would start mid-message")
        return GenerationOptions(
            max_tokens=self.max_tokens, fit_max_tokens=True, stop=self.stop_sequences or None,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, ignore_eos=self.ignore_eos,
            **structure, continue_final_message=prefill,
        )

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


# Claude Code starts its system prompt with a line `x-anthropic-billing-header: cc_version=...;
# cc_entrypoint=...;` whose value changes between requests of one conversation: kept, it would
# end every prompt-cache hit at the system prompt's first line, and it means nothing to a model.
_VOLATILE_LINE = re.compile(r"^x-anthropic-billing-header:[^\n]*(?:\n|$)", re.MULTILINE)


def _stable(text: str) -> str:
    """System text without the client's volatile header lines (`_VOLATILE_LINE`)."""
    return _VOLATILE_LINE.sub("", text) if "x-anthropic-billing-header:" in text else text


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


def _system_text(blocks: str | Sequence[Block | SystemBlock] | None, param: str) -> str:
    """System text, its volatile header lines dropped, and blocks left empty by that too."""
    if blocks is None or isinstance(blocks, str):
        return _stable(blocks or "")
    _text(blocks, param)  # text blocks only
    return "\n".join(t for b in blocks if (t := _stable(b.text or "")))


def _media(kind: str) -> dict[str, Any]:
    """An OpenAI-shaped content part for media the engine's policy handles (`engine/_text.py`:
    refused in the user's last turn, a note elsewhere); its data is never read."""
    return {"type": "image_url", "image_url": {"url": ""}} if kind == "image" else {"type": "file", "file": {}}


def _document_text(b: Block) -> str | None:
    """A document block's text when it has one (a plain-text or content source), else None."""
    source = b.source or {}
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        body = source["data"]
    elif source.get("type") == "content":
        inner = source.get("content")
        if isinstance(inner, str):
            body = inner
        elif isinstance(inner, list):
            body = "\n".join(str(x.get("text", "")) for x in inner if isinstance(x, dict) and x.get("type") == "text")
        else:
            return None
    else:
        return None
    return f"{b.title}\n{body}" if b.title else body


def _content(pieces: list[str | dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Texts (joined by a newline) and media parts -> a message's content: a string when all
    are text, else OpenAI's parts."""
    if all(isinstance(p, str) for p in pieces):
        return "\n".join(pieces)  # type: ignore[arg-type]
    parts: list[dict[str, Any]] = []
    for k, p in enumerate(pieces):
        parts.append({"type": "text", "text": ("\n" if k else "") + p} if isinstance(p, str) else p)
    return parts


def _readable(b: Block, param: str) -> str | dict[str, Any] | None:
    """A user-side block as text, a media part, or None when it is not one of those."""
    if b.type == "text":
        if b.text is None:
            raise _bad(f"{param}.text", "a text block needs text")
        return b.text
    if b.type == "image":
        return _media("image")
    if b.type == "document":
        text = _document_text(b)
        return text if text is not None else _media("document")
    return None


def chat_messages(system: str | list[SystemBlock] | None, messages: list[InputMessage]) -> list[dict[str, Any]]:
    """Anthropic's system and messages -> OpenAI-shaped chat messages.

    An assistant turn's `tool_use` blocks become its `tool_calls`; a user turn's
    `tool_result` blocks become `role: "tool"` messages, in block order around
    its text; a system turn inside `messages` stays a system message, where it is.
    Thinking blocks (a model's own earlier reasoning, sent back) are dropped.
    Plain-text documents are read as text; images and other documents become
    media parts, which the engine refuses in the user's last turn and notes
    elsewhere (the models served read text only).
    """
    out: list[dict[str, Any]] = []
    if system and (text := _system_text(system, "system")):
        out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        param = f"messages.{i}.content"
        blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "system":
            out.append({"role": "system", "content": _system_text(blocks, param)})
            continue
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
        pending: list[str | dict[str, Any]] = []
        for j, b in enumerate(blocks):
            piece = _readable(b, f"{param}.{j}")
            if isinstance(piece, dict) and i == len(messages) - 1:  # the engine's policy, in this API's names
                raise HTTPError(400, f"{param}.{j}: {media_refusal(b.type)}", param=f"{param}.{j}",
                                code="unsupported_content")
            if piece is not None:
                pending.append(piece)
            elif b.type == "tool_result":
                if not b.tool_use_id:
                    raise _bad(f"{param}.{j}", "a tool_result block needs tool_use_id")
                if pending:
                    out.append({"role": "user", "content": _content(pending)})
                    pending = []
                result = _tool_result(b, f"{param}.{j}.content")
                if b.is_error:
                    result = (f"Error: {result}" if isinstance(result, str)
                              else [{"type": "text", "text": "Error:"}, *result])
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": result})
            else:
                raise _bad(f"{param}.{j}", f"only text, image, document and tool_result blocks are "
                                           f"supported in a user turn, got type {b.type!r}")
        if pending or not blocks:
            out.append({"role": "user", "content": _content(pending)})
    return out


def _tool_result(b: Block, param: str) -> str | list[dict[str, Any]]:
    """A tool_result's content: its text, with media parts where it holds images (a screenshot,
    an image file read)."""
    if b.content is None or isinstance(b.content, str):
        return b.content or ""
    pieces: list[str | dict[str, Any]] = []
    for j, inner in enumerate(b.content):
        piece = _readable(inner, f"{param}.{j}")
        if piece is None:
            raise _bad(f"{param}.{j}", f"a tool_result may hold text, image and document blocks, "
                                       f"got type {inner.type!r}")
        pieces.append(piece)
    return _content(pieces)


def chat_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for t in tools:  # client tools only (`Tool._client_tool`)
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
