"""Anthropic's and the Responses API's requests, translated into the engine's OpenAI-shaped chat
(no server): the shapes by hand, and any JSON in gives a translation or a clear 400, nothing else."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from trio_mlx.server._http import HTTPError, error_from_exception
from trio_mlx.server.anthropic._protocol import CountTokensRequest, MessagesRequest
from trio_mlx.server.anthropic._protocol import error_body as anthropic_error
from trio_mlx.server.responses._protocol import ResponsesRequest

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def anthropic_chat(body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, **body})
    return req.chat_messages(), req.structure()


def test_anthropic_history_with_tool_use_and_results():
    messages, structure = anthropic_chat({
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools.", "cache_control": {}}],
        "tools": [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER_SCHEMA}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "output_config": {"format": {"type": "json_schema", "schema": WEATHER_SCHEMA}},
        "messages": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "x"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "Rain"}],
                 "is_error": True},
                {"type": "text", "text": "And tomorrow?"}]},
        ]})
    assert messages == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: Rain"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert structure == {
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA,
                                                    "description": "Weather"}}],
        "tool_choice": "required", "parallel_tool_calls": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": WEATHER_SCHEMA,
                                                                   "strict": True}},
    }


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
])
def test_anthropic_tool_choices(choice, expected):
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    assert anthropic_chat({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                           "tool_choice": choice})[1]["tool_choice"] == expected


def test_anthropic_error_body():
    body = json.loads(anthropic_error(HTTPError(429, "queue full")))
    assert body == {"type": "error", "error": {"type": "rate_limit_error", "message": "queue full"}}
    assert json.loads(anthropic_error(HTTPError(404, "x")))["error"]["type"] == "not_found_error"
    assert json.loads(anthropic_error(HTTPError(503, "x")))["error"]["type"] == "overloaded_error"


def responses_chat(body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    req = ResponsesRequest.model_validate(body)
    req.check()
    return req.chat_messages(), req.structure()


def test_responses_input_items_and_options():
    messages, structure = responses_chat({
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "call_1", "name": "w", "arguments": '{"city":"Paris"}'},
            {"type": "function_call", "call_id": "call_2", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "?"}]},
            {"type": "function_call", "call_id": "call_3", "name": "w", "arguments": "{}"},
        ],
        "tools": [{"type": "function", "name": "w", "parameters": WEATHER_SCHEMA, "strict": True}],
        "tool_choice": {"type": "function", "name": "w"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "city", "schema": WEATHER_SCHEMA, "strict": True}},
        "store": False,
    })
    call = lambda i, a: {"id": f"call_{i}", "type": "function", "function": {"name": "w", "arguments": a}}  # noqa: E731
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call(1, '{"city":"Paris"}'), call(2, "{}")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "?"},
        {"role": "assistant", "content": "", "tool_calls": [call(3, "{}")]},
    ]
    assert structure == {
        "tools": [{"type": "function", "function": {"name": "w", "parameters": WEATHER_SCHEMA, "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "w"}}, "parallel_tool_calls": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": WEATHER_SCHEMA,
                                                                   "strict": True}},
    }
    assert responses_chat({"input": "hi", "text": {"format": {"type": "json_object"}}})[1] == {
        "response_format": {"type": "json_object"}}
    assert responses_chat({"input": "hi"}) == ([{"role": "user", "content": "hi"}], {})


# ---- any JSON in: a translation or a 400, never another exception ------------------------------

_leaf = st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-2, 2) | st.sampled_from(
    ["", "x", "user", "assistant", "text", "tool_use", "tool_result", "image", "function", "function_call",
     "function_call_output", "message", "input_text", "json_schema", "json_object", "auto", "any", "tool",
     "none", "required", "reasoning", "thinking", "developer"])
_json = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["type", "role", "content", "text", "id", "name", "input", "tool_use_id", "is_error",
                     "call_id", "arguments", "output", "schema", "format", "input_schema", "parameters"]),
    inner, max_size=4), max_leaves=12)
_KEYS = ["model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences", "temperature",
         "top_k", "stream", "output_config", "input", "instructions", "max_output_tokens", "text", "store",
         "previous_response_id", "parallel_tool_calls"]
_block = st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result", "image", "thinking",
                                                          "input_text", "output_text", "function_call"])},
                               optional={"text": st.text(max_size=3) | _leaf, "id": st.just("t1"),
                                         "name": st.just("f") | _leaf, "input": _json, "tool_use_id": st.just("t1"),
                                         "content": st.text(max_size=3) | _json, "is_error": st.booleans(),
                                         "call_id": st.just("c1"), "arguments": st.just("{}") | _leaf,
                                         "output": _json | st.text(max_size=3)})
_message = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "item_reference"]),
    "content": st.text(max_size=3) | st.lists(_block, max_size=3), "call_id": st.just("c1"),
    "name": st.just("f"), "arguments": st.just("{}"), "output": st.text(max_size=3) | st.lists(_block, max_size=2)})
_conversation = st.lists(_message, max_size=4)
_structured = st.fixed_dictionaries({}, optional={
    "messages": _conversation, "input": _conversation | st.text(max_size=3), "max_tokens": st.integers(0, 3),
    "tools": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "bad name"])}, optional={
        "type": st.sampled_from(["function", "custom", "web_search"]), "input_schema": _json,
        "parameters": _json}), max_size=2),
    "tool_choice": _json, "text": _json, "output_config": _json, "system": _json})
_bodies = st.dictionaries(st.sampled_from(_KEYS), _json, max_size=6) | _structured
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def _translate_or_400(fn: Any) -> None:
    try:
        fn()
    except (ValidationError, HTTPError) as exc:
        error = error_from_exception(exc)
        assert error.status == 400 and error.message


@FUZZ
@given(_bodies)
def test_any_anthropic_body_translates_or_gets_a_400(body):
    _translate_or_400(lambda: anthropic_chat(body))
    _translate_or_400(lambda: CountTokensRequest.model_validate({"model": "m", **body}).tool_options())


@FUZZ
@given(_bodies)
def test_any_responses_body_translates_or_gets_a_400(body):
    _translate_or_400(lambda: responses_chat(body))
