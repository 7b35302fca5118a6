"""One typed request: each API's request model builds one `GenerationOptions`, the engine checks it
once, and an error names its parameter as the client's API names it.

Each API checks its own documented ranges at its boundary (OpenAI's temperature is 0..2,
Anthropic's 0..1); the engine checks what generation needs. The walk below sends every API the
values just inside and just outside each documented bound of each shared parameter, over the fake
actor, and checks the answer: a 200, or a 400 in the API's error shape naming the API's parameter.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from app_server import HELLO, fake_factory, serve

from trio_mlx import GenerationOptions, InvalidRequestError
from trio_mlx.engine._options import MAX_STOP_CHARS, MAX_STOP_STRINGS, check_options
from trio_mlx.server._wire import api_error
from trio_mlx.server.anthropic import _serving as anthropic
from trio_mlx.server.anthropic._protocol import MessagesRequest
from trio_mlx.server.openai._protocol import ChatCompletionRequest, CompletionRequest
from trio_mlx.server.responses import _serving as responses
from trio_mlx.server.responses._protocol import ResponsesRequest

MAX_N = 16  # the server's default max_n
SEEDS = (-(2**63), 2**64 - 1)
STOPS = ["s"] * MAX_STOP_STRINGS

# (parameter as the API names it, values inside its documented bound, values outside)
OPENAI_SHARED = [
    ("max_tokens", [1], [0, 2**31 + 1]),
    ("temperature", [0, 2], [-0.01, 2.01]),
    ("top_p", [0.01, 1], [0, 1.01]),
    ("top_k", [-1, 0, 5], [-2]),
    ("min_p", [0, 1], [-0.01, 1.01]),
    ("repetition_penalty", [0.001, 100], [0.0005, 0, 100.5]),
    ("presence_penalty", [-2, 2], [-2.01, 2.01]),
    ("frequency_penalty", [-2, 2], [-2.01, 2.01]),
    ("logit_bias", [{"1": -100}, {"1": 100}], [{"1": 100.5}, {"1": -101}, {"x": 1}]),
    ("seed", list(SEEDS), [SEEDS[0] - 1, SEEDS[1] + 1]),
    ("n", [1, MAX_N], [0, MAX_N + 1]),
    ("stop", ["s", STOPS], [STOPS + ["s"], ["s" * (MAX_STOP_CHARS + 1)]]),
    ("stop_token_ids", [[1]], [[-1]]),
]
APIS: dict[str, dict[str, Any]] = {
    "chat": {
        "path": "/v1/chat/completions", "base": {"messages": HELLO, "max_tokens": 2},
        "cases": [*OPENAI_SHARED,
                  ("max_completion_tokens", [1], [0]),
                  ("top_logprobs", [0, 20], [-1, 21])],
    },
    "completions": {
        "path": "/v1/completions", "base": {"prompt": "hello", "max_tokens": 2},
        "cases": [*OPENAI_SHARED, ("logprobs", [0, 20], [-1, 21])],
    },
    "messages": {
        "path": "/v1/messages", "base": {"max_tokens": 2, "messages": HELLO},
        "cases": [
            # a ceiling: one past the context is cut to it (fit_max_tokens), not refused
            ("max_tokens", [1, 100_000], [0, 2**31 + 1]),
            ("temperature", [0, 1], [-0.01, 1.01]),
            ("top_p", [0.01, 1], [0, 1.01]),
            ("top_k", [0, 5], [-1]),
            ("stop_sequences", [STOPS], [STOPS + ["s"], ["s" * (MAX_STOP_CHARS + 1)]]),
        ],
    },
    "responses": {
        "path": "/v1/responses", "base": {"input": "hello", "max_output_tokens": 2},
        "cases": [
            ("max_output_tokens", [1], [0, 2**31 + 1]),
            ("temperature", [0, 2], [-0.01, 2.01]),
            ("top_p", [0.01, 1], [0, 1.01]),
        ],
    },
}


def _error_param(api: str, body: dict[str, Any]) -> str:
    """The parameter an error names, read from the API's own error shape."""
    if api == "messages":  # Anthropic's: {"type": "error", "error": {"type", "message"}}, the name leading
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] == "invalid_request_error", body
        return body["error"]["message"]
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"], body
    return body["error"]["param"]


@pytest.mark.parametrize("api", sorted(APIS))
async def test_every_api_refuses_each_documented_bound_in_its_own_names(tiny_model_fp32, api):
    spec = APIS[api]
    async with serve(tiny_model_fp32, factory=fake_factory()) as server, server.client() as client:
        base = dict(spec["base"])
        if api == "messages":
            base["model"] = server.app.settings.served_model_name
        for param, inside, outside in spec["cases"]:
            extra = {"logprobs": True} if param == "top_logprobs" else {}
            for value in inside:
                r = await client.post(spec["path"], json={**base, **extra, param: value})
                assert r.status_code == 200, (api, param, value, r.text)
            for value in outside:
                r = await client.post(spec["path"], json={**base, **extra, param: value})
                assert r.status_code == 400, (api, param, value, r.text)
                named = _error_param(api, r.json())
                if api == "messages":
                    assert named.startswith(param), (param, value, named)
                else:
                    assert named == param, (api, param, value, r.text)


# ---- the record and its field references --------------------------------------------------------


def _set_fields(options: GenerationOptions) -> set[str]:
    default = GenerationOptions()
    return {f.name for f in dataclasses.fields(options) if getattr(options, f.name) != getattr(default, f.name)}


def test_each_translated_api_names_every_field_it_builds() -> None:
    """An engine error about any field the Anthropic or Responses request sets comes back under
    that API's name: its table (`PARAMS`) names each of them."""
    tool = {"name": "f", "input_schema": {"type": "object"}}
    messages = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "stop_sequences": ["x"], "temperature": 0.5, "top_p": 0.5, "top_k": 3,
        "ignore_eos": True, "tools": [tool],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
        "messages": [{"role": "user", "content": "hi"}],
    }).to_options()
    # a prefill goes with neither a format nor a forced tool (a 400 of the API's own)
    prefill = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "tools": [tool], "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]}).to_options()
    fields = _set_fields(messages) | _set_fields(prefill)
    assert fields <= set(anthropic.PARAMS), fields - set(anthropic.PARAMS)
    assert messages.fit_max_tokens and prefill.continue_final_message and messages.stop == ["x"]
    request = ResponsesRequest.model_validate({
        "input": "hi", "max_output_tokens": 5, "temperature": 0.5, "top_p": 0.5, "ignore_eos": True,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "tool_choice": "required",
        "parallel_tool_calls": False, "text": {"format": {"type": "json_object"}},
    }).to_options()
    assert _set_fields(request) <= set(responses.PARAMS), _set_fields(request) - set(responses.PARAMS)
    assert request.max_tokens == 5 and request.response_format == {"type": "json_object"}


def test_a_responses_request_through_sglang_router_keeps_its_meaning() -> None:
    """sglang-router re-serializes a Responses request with every field it knows, `stream: null`
    among them when the client left it out: null is not streamed, as OpenAI's API takes it."""
    from trio_mlx.server.responses._serving import ResponsesCall

    routed = {"input": "Hello", "max_output_tokens": 4, "model": "m", "store": False, "stream": None,
              "temperature": 1.0, "top_p": 1.0, "priority": 0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    call = ResponsesCall(ResponsesRequest.model_validate(routed))
    assert call.stream is False and call.options.max_tokens == 4
    assert ResponsesCall(ResponsesRequest.model_validate({**routed, "stream": True})).stream is True


def test_openai_requests_build_the_record_in_the_records_names() -> None:
    chat = ChatCompletionRequest.model_validate({
        "messages": HELLO, "max_completion_tokens": 7, "top_k": -1, "logprobs": True, "top_logprobs": 2,
        "seed": 3, "stop": "x", "continue_final_message": True})
    assert chat.to_options() == GenerationOptions(max_tokens=7, top_k=0, logprobs=True, top_logprobs=2, seed=3,
                                                  stop="x", continue_final_message=True)
    completion = CompletionRequest.model_validate({"prompt": "a", "logprobs": 0})
    assert completion.to_options() == GenerationOptions(max_tokens=16, logprobs=True, top_logprobs=0)


def test_an_error_names_its_field_and_each_api_maps_it() -> None:
    err = InvalidRequestError("stop must be a string or a list of at most 16 strings", param="stop")
    assert err.field == "stop"
    renamed = api_error(err, anthropic.PARAMS)
    assert (renamed.param, renamed.message) == ("stop_sequences", "stop_sequences must be a string or a list "
                                                                  "of at most 16 strings")
    # the place inside the field is kept; OpenAI's `.function.` level of a tool is not
    err = InvalidRequestError("tools[1].function.parameters must be a JSON schema of type 'object'",
                              param="tools[1]")
    assert api_error(err, anthropic.PARAMS).message == "tools[1].parameters must be a JSON schema of type 'object'"
    # an index into the translated chat is not the client's: dropped
    err = InvalidRequestError("messages[3].content[0]: no", param="messages[3].content[0]")
    renamed = api_error(err, responses.PARAMS)
    assert (renamed.param, renamed.message) == ("input.content[0]", "input.content[0]: no")
    err = InvalidRequestError("response_format.json_schema must be an object", param="response_format")
    renamed = api_error(err, responses.PARAMS)
    assert (renamed.param, renamed.message) == ("text.format", "text.format.json_schema must be an object")
    # a message that does not start with its field keeps its words; an unnamed field its name
    err = InvalidRequestError("a stop string is too long", param="stop", code="x")
    renamed = api_error(err, anthropic.PARAMS)
    assert (renamed.param, renamed.message, renamed.code) == ("stop_sequences", err.message, "x")
    err = InvalidRequestError("seed must be an integer", param="seed")
    assert api_error(err, anthropic.PARAMS) is err


def test_the_answer_limit_is_one_policy() -> None:
    """max_tokens is read once into the checked record, which fits it beside the prompt:
    None takes the engine's default, fit_max_tokens cuts a ceiling to the room left."""
    def limit(room: int, **fields: Any) -> tuple[int, bool]:
        return check_options(GenerationOptions(**fields), {}, 0).answer_limit(room, 100)

    assert limit(50) == (50, False) and limit(500) == (100, False)
    assert limit(50, max_tokens=80) == (80, False)  # refused by the caller: past the room
    assert limit(50, max_tokens=80, fit_max_tokens=True) == (50, True)  # clamped
    assert limit(90, max_tokens=80, fit_max_tokens=True) == (80, False)
    assert limit(0, max_tokens=80, fit_max_tokens=True) == (80, False)  # no room at all: refused
    assert check_options(GenerationOptions(max_tokens=80, fit_max_tokens=True), {}, 0).least_answer == 1
    with pytest.raises(InvalidRequestError) as info:
        check_options(GenerationOptions(temperature=101), {}, 0)
    assert info.value.field == "temperature"


def test_null_is_the_default_where_openai_allows_it() -> None:
    """The openai SDK sends null for a parameter given as None: `logprobs`, `n`, `stream`,
    `parallel_tool_calls` and completions' `echo` were 400s, and completions' `max_tokens: null`
    ran to the server's default length (4096) instead of OpenAI's 16."""
    chat = ChatCompletionRequest.model_validate({"messages": HELLO, "logprobs": None, "n": None, "stream": None,
                                                 "parallel_tool_calls": None, "ignore_eos": None,
                                                 "continue_final_message": None})
    assert (chat.logprobs, chat.n, chat.stream, chat.parallel_tool_calls) == (False, 1, False, True)
    options = chat.to_options()
    assert options.parallel_tool_calls is True and not options.logprobs and not options.ignore_eos
    completion = CompletionRequest.model_validate({"prompt": "x", "max_tokens": None, "echo": None})
    assert completion.max_tokens == 16 and completion.to_options().max_tokens == 16 and completion.echo is False


def test_an_assistant_refusal_part_is_what_it_said_and_belongs_to_the_assistant() -> None:
    """A conversation in which OpenAI refused replays: the assistant's refusal part was a 400."""
    said = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]}
    req = ChatCompletionRequest.model_validate({"messages": [*HELLO, said, *HELLO]})
    assert req.messages[1].template_dict() == {"role": "assistant", "content": "I can't help with that."}
    with pytest.raises(ValueError, match="belongs to an assistant message"):
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]})
