"""Tool calling and structured output over HTTP, with the official openai SDK against a real server.

The SDK's clients block (sync) or run on asyncio, so they run in a worker
thread while the server runs on this test's trio loop. The models are
random-weight: every call and every JSON answer that validates is the
grammar's doing.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import jsonschema
import openai
import pytest
import trio
from app_server import CHAT, COMPLETIONS, assert_error, serve, until
from pydantic import BaseModel, Field
from tool_schemas import ASK, WEATHER_DESCRIPTION, chat_tool, search_parameters, weather_parameters

from trio_mlx.server._openapi import ChatCompletionChunk

pytestmark = pytest.mark.timeout(90)

WEATHER = chat_tool("get_weather", weather_parameters(16), WEATHER_DESCRIPTION)
SEARCH = chat_tool("search", search_parameters(closed=True))
TOOLS = [WEATHER, SEARCH]
ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["a", "b", "c"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "count", "kind", "tags"],
    "additionalProperties": False,
}
ITEM_FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM, "strict": True}}


class Weather(BaseModel):
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)
    unit: Literal["celsius", "fahrenheit"]


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=30)


def args_valid(name: str, arguments: str) -> None:
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), schema)


def tool_calls_sync(url: str) -> dict[str, Any]:
    client, out = sdk(url), {}
    whole = client.chat.completions.create(model="model", messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=80, temperature=0)
    out["whole"] = whole.choices[0]
    named = client.chat.completions.create(
        model="model", messages=ASK, tools=TOOLS, parallel_tool_calls=False, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "search"}})
    out["named"] = named.choices[0]
    # the SDK's own reassembly of the streamed delta.tool_calls chunks
    with client.chat.completions.stream(model="model", messages=ASK, tools=TOOLS, tool_choice="required",
                                        max_tokens=80, temperature=0) as stream:
        out["content_deltas"] = [e.delta for e in stream if e.type == "content.delta"]
        out["streamed"] = stream.get_final_completion().choices[0]
    # the next turn: the call and its result in the history
    call = whole.choices[0].message.tool_calls[0]
    history = [*ASK, whole.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    out["next_turn"] = client.chat.completions.create(model="model", messages=history, tools=TOOLS,
                                                      max_tokens=5, temperature=0).choices[0]
    # some clients send the arguments as an object: the same prompt
    as_object = [*ASK, {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function", "function": {
        "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]}, history[-1]]
    out["next_turn_object"] = client.chat.completions.create(model="model", messages=as_object, tools=TOOLS,
                                                             max_tokens=5, temperature=0).choices[0]
    return out


async def test_tool_calls_whole_streamed_and_in_history(tool_model_fp32):
    async with serve(tool_model_fp32) as server:
        out = await trio.to_thread.run_sync(tool_calls_sync, server.url)
    whole = out["whole"]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert whole.message.tool_calls, whole
    for call in whole.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        args_valid(call.function.name, call.function.arguments)
    named = out["named"]
    assert [c.function.name for c in named.message.tool_calls] == ["search"]
    args_valid("search", named.message.tool_calls[0].function.arguments)
    streamed = out["streamed"]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert not any("tool_call" in d for d in out["content_deltas"])  # no markup leaks into content
    assert out["next_turn"].finish_reason in ("length", "stop", "tool_calls")
    assert out["next_turn_object"].message.content == out["next_turn"].message.content


def parse_sync(url: str) -> list[Any]:
    client = sdk(url)
    out = []
    for temperature in (0.0, 1.0):
        done = client.chat.completions.parse(model="model", messages=ASK, response_format=Weather,
                                             max_tokens=80, temperature=temperature, seed=7)
        out.append(done.choices[0].message.parsed)
    tool = client.chat.completions.parse(model="model", messages=ASK, tools=[openai.pydantic_function_tool(Weather)],
                                         tool_choice="required", max_tokens=80, temperature=0)
    out.append(tool.choices[0].message.tool_calls[0].function.parsed_arguments)
    return out


async def test_sdk_parse_with_a_pydantic_model(tool_model_fp32):
    async with serve(tool_model_fp32) as server:
        parsed = await trio.to_thread.run_sync(parse_sync, server.url)
    assert len(parsed) == 3 and all(isinstance(p, Weather) for p in parsed)


async def constrained_many(url: str, temperature: float) -> list[tuple[str, str]]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=60) as client:
        async def chat(i: int) -> tuple[str, str]:
            fmt = ITEM_FORMAT if i % 2 == 0 else {"type": "json_object"}
            if i % 4 == 3:  # a streamed one among them
                pieces = []
                async for chunk in await client.chat.completions.create(
                        model="model", messages=[{"role": "user", "content": f"item {i}"}], response_format=fmt,
                        max_tokens=60, temperature=temperature, seed=i, stream=True):
                    pieces += [c.delta.content or "" for c in chunk.choices]
                return "object", "".join(pieces)
            r = await client.chat.completions.create(model="model", messages=[{"role": "user", "content": f"item {i}"}],
                                                     response_format=fmt, max_tokens=60, temperature=temperature, seed=i)
            return ("item" if i % 2 == 0 else "object"), r.choices[0].message.content or ""

        async def complete(i: int) -> tuple[str, str]:
            r = await client.completions.create(model="model", prompt=f"item {i}", max_tokens=60,
                                                temperature=temperature, seed=i,
                                                extra_body={"response_format": ITEM_FORMAT})
            return "item", r.choices[0].text

        return list(await asyncio.gather(*[chat(i) for i in range(12)], *[complete(i) for i in range(4)]))


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
async def test_16_concurrent_constrained_answers_all_validate(tool_model_fp32, temperature):
    async with serve(tool_model_fp32, max_batch=16) as server:
        out = await trio.to_thread.run_sync(lambda: asyncio.run(constrained_many(server.url, temperature)))
        assert server.engine.statistics().step_failures == 0
    assert len(out) == 16
    for kind, text in out:
        value = json.loads(text)
        if kind == "item":
            jsonschema.validate(value, ITEM)
        else:
            assert isinstance(value, dict)


async def test_disconnect_during_a_constrained_stream_frees_the_slot(tool_model_fp32):
    async with serve(tool_model_fp32) as server, server.client() as client:
        engine = server.engine
        body = {"messages": ASK, "max_tokens": 600, "stream": True, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
                    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}}
        async with client.stream("POST", CHAT, json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    break
            assert engine.statistics().decoding == 1
        await until(lambda: engine.statistics().active == 0, within=5)
        stats = engine.statistics()
        assert stats.aborts_by_stage.get("decode") == 1 and stats.decoding == 0
        again = await client.post(CHAT, json={**body, "stream": False, "max_tokens": 40})
        assert again.status_code == 200
        assert isinstance(json.loads(again.json()["choices"][0]["message"]["content"]), dict)


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0]", "name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "'function'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, "response_format", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(unclosed"}}}}, "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({"response_format": {}}, "response_format", "None"),
    ({"response_format": {"type": "json_object"}, "max_tokens": 1}, "max_tokens", "at least"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "both"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{not json"}}]}]}, "messages[1].tool_calls", "not JSON"),
]


async def test_bad_tools_and_formats_are_clear_400s(tool_model_fp32, tiny_model_fp32):
    async with serve(tool_model_fp32) as server, server.client() as client:
        for extra, param, needle in BAD:
            resp = await client.post(CHAT, json={"messages": ASK, "max_tokens": 8, **extra})
            err = assert_error(resp, 400, param=param)
            assert needle in err["message"], (extra, err)
        resp = await client.post(COMPLETIONS, json={"prompt": "x", "response_format": {"type": "json_schema"}})
        assert_error(resp, 400, param="response_format")
        assert server.engine.statistics().requests_submitted == 0
        ok = await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 30,
                                                  "response_format": {"type": "json_object"}})
        assert ok.status_code == 200 and isinstance(json.loads(ok.json()["choices"][0]["text"]), dict)
    async with serve(tiny_model_fp32) as server, server.client() as client:
        resp = await client.post(CHAT, json={"messages": ASK, "tools": TOOLS})
        err = assert_error(resp, 400, param="tools")
        assert "does not support tool calling" in err["message"]
        # tool_choice "none": the tools are not rendered, so any model serves it
        resp = await client.post(CHAT, json={"messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2})
        assert resp.status_code == 200 and "tool_calls" not in resp.json()["choices"][0]["message"]


async def test_n_choices_each_make_calls(tool_model_fp32):
    async with serve(tool_model_fp32) as server, server.client() as client:
        resp = await client.post(CHAT, json={"messages": ASK, "tools": TOOLS, "tool_choice": "required", "n": 3,
                                             "max_tokens": 80, "temperature": 1.0, "seed": 5})
        assert resp.status_code == 200, resp.text
        choices = resp.json()["choices"]
        for c in choices:
            assert c["finish_reason"] == "tool_calls"
            for call in c["message"]["tool_calls"]:
                args_valid(call["function"]["name"], call["function"]["arguments"])
        # the same, streamed: every choice's calls arrive as delta.tool_calls
        calls: dict[int, list[Any]] = {}
        finish: dict[int, str] = {}
        async with client.stream("POST", CHAT, json={"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                                     "n": 3, "max_tokens": 80, "temperature": 1.0, "seed": 5,
                                                     "stream": True}) as s:
            async for line in s.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                for c in json.loads(line[6:])["choices"]:
                    calls.setdefault(c["index"], []).extend(c["delta"].get("tool_calls") or [])
                    assert "tool_call>" not in (c["delta"].get("content") or "")
                    if c["finish_reason"]:
                        finish[c["index"]] = c["finish_reason"]
        assert finish == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
        assert {i: reassemble(v) for i, v in calls.items()} == {
            i: [(t["function"]["name"], t["function"]["arguments"]) for t in c["message"]["tool_calls"]]
            for i, c in enumerate(choices)}


def reassemble(entries: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """`delta.tool_calls` entries joined as OpenAI's clients join them: by index, the
    name from the first, the arguments fragments concatenated."""
    calls: dict[int, list[str]] = {}
    for e in entries:
        fn = e["function"]
        if e["index"] not in calls:
            assert e["id"].startswith("call_") and e["type"] == "function" and fn["arguments"] == ""
            calls[e["index"]] = [fn["name"], ""]
        else:
            assert set(e) == {"index", "function"} and set(fn) == {"arguments"}
        calls[e["index"]][1] += fn["arguments"]
    return [(name, args) for name, args in calls.values()]


async def test_a_streamed_call_arrives_in_argument_fragments(tool_model_fp32):
    """tool_choice "required" forces a call: its first chunk has the index, id, type and
    name with arguments "", then its arguments come in several fragments as the model
    writes them; joined they are the non-streamed call's arguments, as JSON."""
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 80, "temperature": 0,
            "parallel_tool_calls": False}
    async with serve(tool_model_fp32) as server, server.client() as client:
        whole = (await client.post(CHAT, json=body)).json()["choices"][0]
        entries: list[dict[str, Any]] = []
        async with client.stream("POST", CHAT, json={**body, "stream": True}) as s:
            async for line in s.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    ChatCompletionChunk.model_validate(chunk)  # the shape /openapi.json documents
                    for c in chunk["choices"]:
                        entries += c["delta"].get("tool_calls") or []
    (call,) = whole["message"]["tool_calls"]
    assert reassemble(entries) == [(call["function"]["name"], call["function"]["arguments"])]
    fragments = [e["function"]["arguments"] for e in entries[1:]]
    assert len(fragments) > 1 and all(fragments), entries
    args_valid(call["function"]["name"], "".join(fragments))


async def test_logprobs_with_tool_calls(tool_model_fp32):
    """Every token of the answer has its logprob, the call markup's too, though the markup is
    not content; the stop token that ends it is not text, so it has none (as for content)."""
    async with serve(tool_model_fp32) as server, server.client() as client:
        body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 60, "temperature": 0,
                "logprobs": True, "top_logprobs": 2}
        whole = (await client.post(CHAT, json=body)).json()
        choice = whole["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert len(choice["logprobs"]["content"]) == whole["usage"]["completion_tokens"] - 1
        streamed, calls = [], []
        async with client.stream("POST", CHAT, json={**body, "stream": True}) as s:
            async for line in s.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        streamed += (c.get("logprobs") or {}).get("content") or []
                        calls += c["delta"].get("tool_calls") or []
                        assert not c["delta"].get("content")
        assert [t["token"] for t in streamed] == [t["token"] for t in choice["logprobs"]["content"]]
        assert reassemble(calls) == [
            (t["function"]["name"], t["function"]["arguments"]) for t in choice["message"]["tool_calls"]]
