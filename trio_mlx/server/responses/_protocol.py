"""OpenAI's Responses API on the wire: the request model and its translation into the engine's
OpenAI-shaped chat messages, tools and response format.

Field names follow the official `openai` SDK's types (`openai.types.responses`:
`ResponseCreateParams`, `EasyInputMessageParam`, `ResponseFunctionToolCallParam`,
`FunctionCallOutput`, `FunctionToolParam`, `ResponseTextConfigParam`). The
server keeps no responses: a request carries its whole conversation in
`input` (`store` false or absent), and `previous_response_id` or a
`conversation` get a 400 saying so.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .._openai import HTTPError


class _Strict(BaseModel):
    # Unknown fields are ignored (clients send many: metadata, include, reasoning, ...); types are strict.
    model_config = ConfigDict(extra="ignore", strict=True)


class ContentPart(_Strict):
    type: str
    text: str | None = None


class InputItem(_Strict):
    """A message (`role` and `content`), a `function_call` the model made, or a
    `function_call_output` the client sends back; which fields matter depends on `type`."""

    type: str | None = Field(None, description="message (the default when role is given), "
                                               "function_call, function_call_output")
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class FunctionTool(_Strict):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(_Strict):
    """`POST /v1/responses`."""

    model: str | None = Field(None, description="the served model id; absent: the served model")
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = Field(None, description="must be false or absent: this server keeps no responses")
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    ignore_eos: bool = Field(False, description="an extension (as on the chat endpoint): "
                                                "generate max_output_tokens tokens")

    def check(self) -> None:
        if self.previous_response_id is not None:
            raise _bad("previous_response_id", "this server keeps no responses: send the whole "
                       "conversation in input (with store false) instead of previous_response_id")
        if self.conversation is not None:
            raise _bad("conversation", "this server keeps no conversations: send the whole "
                       "conversation in input")
        if self.store:
            raise _bad("store", "this server keeps no responses: send store false (or leave it out)")
        if self.background:
            raise _bad("background", "background responses are not supported by this server")

    def engine_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {}
        if self.max_output_tokens is not None:
            opts["max_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if value is not None:
                opts[name] = value
        if self.ignore_eos:
            opts["ignore_eos"] = True
        return opts

    def structure(self) -> dict[str, Any]:
        """`engine.chat`'s tools, tool_choice, parallel_tool_calls and response_format."""
        out: dict[str, Any] = {}
        tools = chat_tools(self.tools)
        if tools:
            out["tools"] = tools
            if self.tool_choice is not None:
                out["tool_choice"] = chat_tool_choice(self.tool_choice)
            if self.parallel_tool_calls is False:
                out["parallel_tool_calls"] = False
        elif self.tool_choice not in (None, "none", "auto"):
            raise _bad("tool_choice", f"tool_choice {self.tool_choice!r} needs tools")
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type != "text":
            out["response_format"] = response_format(fmt)
        return out

    def chat_messages(self) -> list[dict[str, Any]]:
        return chat_messages(self.instructions, self.input)


def _bad(param: str, message: str, code: str = "invalid_value") -> HTTPError:
    return HTTPError(400, f"{param}: {message}", param=param, code=code)


def _text(content: str | list[ContentPart] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text", "text") or part.text is None:
            raise _bad(f"{param}.{j}", f"only text content is supported, got type {part.type!r}")
        texts.append(part.text)
    return "".join(texts)


def chat_messages(instructions: str | None, items: str | list[InputItem]) -> list[dict[str, Any]]:
    """`instructions` and `input` -> OpenAI-shaped chat messages.

    `function_call` items join the assistant message before them as its
    `tool_calls` (a response's output is a message, then its calls);
    `function_call_output` items become `role: "tool"` messages; reasoning
    items (a model's own, sent back) are dropped.
    """
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        out.append({"role": "user", "content": items})
        return out
    for i, item in enumerate(items):
        kind = item.type or ("message" if item.role else None)
        param = f"input.{i}"
        if kind == "message":
            if item.role is None:
                raise _bad(f"{param}.role", "a message needs a role")
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(item.content, f"{param}.content")})
        elif kind == "function_call":
            if not item.call_id or not item.name or item.arguments is None:
                raise _bad(param, "a function_call item needs call_id, name and arguments")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not item.call_id:
                raise _bad(param, "a function_call_output item needs call_id")
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _text(item.output, f"{param}.output")})
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise _bad(param, "this server keeps no items: send the item itself, not a reference")
        else:
            raise _bad(f"{param}.type", "input items may be messages, function_call and "
                                        f"function_call_output, got {kind!r}")
    if not out:
        raise _bad("input", "the input holds no message")
    return out


def chat_tools(tools: list[FunctionTool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.type != "function":
            raise _bad(f"tools.{i}.type", f"only function tools are supported, got {t.type!r}",
                       "unsupported_parameter")
        if not t.name:
            raise _bad(f"tools.{i}.name", "a function tool needs a name")
        function: dict[str, Any] = {"name": t.name, "parameters": t.parameters or {"type": "object"}}
        if t.description is not None:
            function["description"] = t.description
        if t.strict is not None:
            function["strict"] = t.strict
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    """"auto" / "none" / "required" as they are; {"type": "function", "name"} nested as chat's."""
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _bad("tool_choice", f"tool_choice must be 'auto', 'none', 'required' or a function, got {choice!r}")
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice", 'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}')


def response_format(fmt: TextFormat) -> dict[str, Any]:
    """`text.format` -> chat's `response_format`."""
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise _bad("text.format.schema", "a json_schema format needs its schema")
    spec: dict[str, Any] = {"name": fmt.name or "output", "schema": fmt.schema_}
    if fmt.strict is not None:
        spec["strict"] = fmt.strict
    if fmt.description is not None:
        spec["description"] = fmt.description
    return {"type": "json_schema", "json_schema": spec}
