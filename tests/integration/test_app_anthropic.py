"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) against a real server,
through the official `anthropic` SDK (its clients run in a worker thread) and raw HTTP.

Here the API on a real model; the refusals made before a request is routed:
tests/unit/test_app_anthropic.py.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

import pytest
import trio
from app_server import engine_factory, open_raw, serve, slow_steps, until
from tool_schemas import ASK, WEATHER_DESCRIPTION, search_parameters, weather_parameters

from integration.test_app_cancel import assert_disconnects_free_the_slot

if TYPE_CHECKING:
    import anthropic

# The SDK is imported by the first test (conftest.py's anthropic_sdk: once per worker that runs
# this module, and frozen out of the collector's walks), not at collection.
pytestmark = pytest.mark.usefixtures("anthropic_sdk")
MESSAGES = "/v1/messages"
USER = [{"role": "user", "content": "Hello there"}]
# This SDK no longer sends sampling parameters (newer models fix them); the API still takes them.
GREEDY = {"temperature": 0}


def sdk(url: str, **kw) -> anthropic.Anthropic:
    import anthropic  # loaded already (pytestmark)

    return anthropic.Anthropic(base_url=url, api_key=kw.pop("api_key", "k"), max_retries=0, timeout=20, **kw)


def text_calls(url: str) -> dict:
    client = sdk(url)
    out: dict = {}
    msg = client.messages.create(model="model", max_tokens=6, extra_body=GREEDY, messages=USER,
                                 system="You are terse.")
    out["whole"] = msg
    with client.messages.stream(model="model", max_tokens=6, extra_body=GREEDY, messages=USER,
                                system=[{"type": "text", "text": "You are terse."}]) as stream:
        out["streamed_text"] = "".join(stream.text_stream)
        out["streamed"] = stream.get_final_message()
    events = list(client.messages.create(model="model", max_tokens=6, extra_body=GREEDY, messages=USER,
                                         system="You are terse.", stream=True))
    out["event_types"] = [e.type for e in events]
    out["count"] = client.messages.count_tokens(model="model", messages=USER, system="You are terse.")
    return out


async def test_text_messages_whole_streamed_and_counted(tiny_model_fp32):
    async with serve(tiny_model_fp32) as server:
        out = await trio.to_thread.run_sync(text_calls, server.url)
        prompt = server.engine.encode_prompt("chat", [{"role": "system", "content": "You are terse."}, *USER])
    whole, streamed = out["whole"], out["streamed"]
    assert whole.type == "message" and whole.role == "assistant" and whole.model == "model"
    assert whole.id.startswith("msg_")
    assert whole.usage.input_tokens == len(prompt) == out["count"].input_tokens
    assert 1 <= whole.usage.output_tokens <= 6
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert (whole.stop_reason == "max_tokens") == (whole.usage.output_tokens == 6)
    assert [b.type for b in whole.content] == ["text"]
    # Greedy: the stream says exactly what the whole response said, and ends the same way.
    assert out["streamed_text"] == streamed.content[0].text == whole.content[0].text
    assert streamed.stop_reason == whole.stop_reason and streamed.usage.output_tokens == whole.usage.output_tokens
    assert streamed.usage.input_tokens == whole.usage.input_tokens
    types = out["event_types"]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert types[1] == "content_block_start" and types[-3] == "content_block_stop"
    assert set(types[2:-3]) <= {"content_block_delta"}


def stop_sequence_call(url: str, text: str) -> anthropic.types.Message:
    return sdk(url).messages.create(model="model", max_tokens=20, extra_body=GREEDY, messages=USER,
                                    stop_sequences=[text])


async def test_stop_sequences_report_which_one_stopped(tiny_model_fp32):
    async with serve(tiny_model_fp32) as server:
        free = await trio.to_thread.run_sync(lambda: sdk(server.url).messages.create(
            model="model", max_tokens=20, extra_body=GREEDY, messages=USER))
        text = free.content[0].text
        if len(text) < 4:
            pytest.skip("the random model ended at once")  # pragma: no cover
        stop = text[2:4]
        msg = await trio.to_thread.run_sync(stop_sequence_call, server.url, stop)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[: text.index(stop)]


async def test_errors_have_anthropics_shape(tiny_model_fp32):
    async with serve(tiny_model_fp32) as server, server.client() as client:
        async def error(body, status, *, path=MESSAGES, headers=None) -> str:
            r = await client.post(path, json=body, headers=headers)
            assert r.status_code == status, r.text
            obj = r.json()
            assert obj["type"] == "error" and set(obj) == {"type", "error"}, obj
            assert set(obj["error"]) == {"type", "message"} and obj["error"]["message"]
            return obj["error"]["type"] + ": " + obj["error"]["message"]

        base = {"model": "model", "max_tokens": 4, "messages": USER}
        assert "max_tokens" in await error({"model": "model", "messages": USER}, 400)
        assert (await error({**base, "model": "claude-x"}, 404)).startswith("not_found_error")
        img = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
        msg = await error({**base, "messages": [{"role": "user", "content": [img]}]}, 400)
        assert msg.startswith("invalid_request_error") and "reads text only" in msg and "messages.0.content.0" in msg
        # as clients send them: no input_schema (its absence was the 400's whole message), fields of their own
        server_tool = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
        assert "server tools ('web_search_20250305')" in await error({**base, "tools": [server_tool]}, 400)
        assert "server tools" in await error({**base, "tools": [{**server_tool, "input_schema": {}}]}, 400)
        assert "needs tools" in await error({**base, "tool_choice": {"type": "any"}}, 400)
        said = await error({**base, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400)
        assert "messages.0.content.0.text: a text block needs text" in said, said  # not "got type 'text'"
        # the engine's check of a tool's schema, in this API's name for it (it said `parameters`)
        said = await error({**base, "tools": [{"name": "f", "input_schema": {"type": "array"}}]}, 400)
        assert "tools[0].input_schema must be a JSON schema of type 'object'" in said, said
        assert "temperature" in await error({**base, "temperature": 1.5}, 400)
        long = [{"role": "user", "content": "word " * 3000}]  # past the tiny model's 1024 tokens
        # An overflow in Anthropic's wording, the one Claude Code recognizes (it compacts on it).
        msg = await error({**base, "messages": long}, 400)
        assert re.fullmatch(r"invalid_request_error: prompt is too long: \d+ tokens > 1024 maximum", msg), msg
        # past the context once tokenized (not by the bound on characters): max_tokens is a
        # ceiling that finds no room at all, and the count is the prompt's, not "-2291 more"
        msg = await error({**base, "messages": [{"role": "user", "content": "hello " * 1100}]}, 400)
        n = int(re.fullmatch(r"invalid_request_error: prompt is too long: (\d+) tokens > 1024 maximum", msg)[1])
        assert n >= 1024, msg
        assert (await error({**base, "stop_sequences": ["x"] * 17}, 400)).startswith(
            "invalid_request_error: stop_sequences must be")
        # count_tokens counts what does not fit, too (a client checks before it sends).
        r = await client.post(MESSAGES + "/count_tokens", json={"model": "model", "messages": long})
        assert r.status_code == 200 and r.json()["input_tokens"] > 1024
        r = await client.post(MESSAGES, content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert (await error({"model": "model"}, 400, path=MESSAGES + "/count_tokens")).startswith(
            "invalid_request_error")
        r = await client.get(MESSAGES)
        assert r.status_code == 405 and r.json()["type"] == "error"


def auth_calls(url: str) -> tuple[str, str]:
    import anthropic

    good = sdk(url, api_key="sekret").messages.create(model="model", max_tokens=2, messages=USER)
    with pytest.raises(anthropic.AuthenticationError) as info:
        sdk(url, api_key="wrong").messages.create(model="model", max_tokens=2, messages=USER)
    return good.type, info.value.body["error"]["type"]


def clamped_call(url: str) -> anthropic.types.Message:
    return sdk(url).messages.create(model="model", max_tokens=10**6, messages=USER,
                                    extra_body={**GREEDY, "ignore_eos": True})


async def test_max_tokens_past_the_context_runs_to_its_end(tiny_model_fp32):
    """Clients send large max_tokens whatever the prompt: the context's end is the limit then."""
    async with serve(tiny_model_fp32) as server:
        msg = await trio.to_thread.run_sync(clamped_call, server.url)
        context = server.engine.context_length
    assert msg.stop_reason == "model_context_window_exceeded"
    assert msg.usage.input_tokens + msg.usage.output_tokens == context


async def test_x_api_key_or_bearer(tiny_model_fp32):
    async with serve(tiny_model_fp32, api_key="sekret") as server, server.client() as client:
        assert await trio.to_thread.run_sync(auth_calls, server.url) == ("message", "authentication_error")
        body = {"model": "model", "max_tokens": 2, "messages": USER}
        assert (await client.post(MESSAGES, json=body, headers={"x-api-key": "sekret"})).status_code == 200
        assert (await client.post(MESSAGES, json=body, headers={"authorization": "Bearer sekret"})).status_code == 200
        r = await client.post(MESSAGES, json=body, headers={"x-api-key": "nope"})
        assert r.status_code == 401 and "x-api-key" in r.json()["error"]["message"]
        # The OpenAI endpoints keep to Bearer.
        chat = {"messages": USER, "max_tokens": 2}
        r = await client.post("/v1/chat/completions", json=chat, headers={"x-api-key": "sekret"})
        assert r.status_code == 401


async def test_disconnect_mid_stream_frees_the_slot(tiny_model_fp32):
    body = {"model": "model", "max_tokens": 900, "messages": USER, "ignore_eos": True}
    await assert_disconnects_free_the_slot(tiny_model_fp32, MESSAGES, body)


WEATHER = {"name": "get_weather", "description": WEATHER_DESCRIPTION, "input_schema": weather_parameters(20)}
SEARCH = {"name": "search", "input_schema": search_parameters(closed=False)}


def tool_round_trip(url: str) -> dict:
    """A forced call, whole and streamed; its result sent back; the reply and its count."""
    client = sdk(url)
    out: dict = {}
    kw = dict(model="model", max_tokens=60, tools=[WEATHER, SEARCH], extra_body=GREEDY)
    out["any"] = client.messages.create(messages=ASK, tool_choice={"type": "any"}, **kw)
    with client.messages.stream(messages=ASK, tool_choice={"type": "tool", "name": "get_weather"}, **kw) as stream:
        out["events"] = [e.type for e in stream]
        out["streamed"] = stream.get_final_message()
    call = out["streamed"].content[-1]
    history = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out["streamed"].content]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"},
                   {"type": "text", "text": "Thanks. Summarize."}]}]
    out["reply"] = client.messages.create(messages=history, tool_choice={"type": "none"}, **kw)
    out["count"] = client.messages.count_tokens(model="model", messages=history, tools=[WEATHER, SEARCH])
    out["count_plain"] = client.messages.count_tokens(model="model", messages=history)
    return out


async def test_tool_use_round_trip(tool_model_fp32):
    import jsonschema

    async with serve(tool_model_fp32) as server:
        out = await trio.to_thread.run_sync(tool_round_trip, server.url)
    forced = out["any"]
    # The grammar forces a call; a random model may write past it until max_tokens (the engine's
    # finish is then "length"), but never anything that is not a call.
    assert forced.stop_reason in ("tool_use", "max_tokens")
    assert not [b for b in forced.content if b.type == "text"]
    uses = [b for b in forced.content if b.type == "tool_use"]
    assert uses and all(u.name in ("get_weather", "search") for u in uses)
    for u in uses:
        jsonschema.validate(u.input, (WEATHER if u.name == "get_weather" else SEARCH)["input_schema"])
    streamed = out["streamed"]
    assert streamed.stop_reason in ("tool_use", "max_tokens")
    # its input streamed in fragments (the SDK's "input_json" events), not in one piece
    assert out["events"].count("input_json") > len([b for b in streamed.content if b.type == "tool_use"])
    assert [b.name for b in streamed.content if b.type == "tool_use"] == ["get_weather"] * len(
        [b for b in streamed.content if b.type == "tool_use"])
    call = streamed.content[-1]
    assert call.type == "tool_use" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])  # the SDK reassembled input_json_delta
    assert "input_json" in out["events"] and out["events"][-1] == "message_stop"
    reply = out["reply"]
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.content[0].type == "text"
    assert not [b for b in reply.content if b.type == "tool_use"]
    # The tools are part of the prompt: counted when sent.
    assert out["count"].input_tokens > out["count_plain"].input_tokens > 0


async def test_output_config_json_schema(tool_model_fp32):

    import jsonschema

    schema = WEATHER["input_schema"]

    def call(url: str) -> str:
        msg = sdk(url).messages.create(model="model", max_tokens=60, messages=ASK, extra_body=GREEDY,
                                       output_config={"format": {"type": "json_schema", "schema": schema}})
        return msg.content[0].text

    async with serve(tool_model_fp32) as server:
        text = await trio.to_thread.run_sync(call, server.url)
    jsonschema.validate(json.loads(text), schema)


async def test_a_client_that_stops_reading_is_cut_by_the_stall_watchdog(tiny_model_fp32):
    """The same watchdog as the chat endpoint's: the stream is aborted, others are served."""
    records = []
    factory = engine_factory(fault_hook=slow_steps(0.003))
    async with serve(tiny_model_fp32, stall_timeout=0.5, factory=factory) as server, server.client() as client:
        server.app.observers.append(records.append)
        engine = server.engine
        body = {"model": "model", "max_tokens": 1000, "messages": USER, "stream": True, "ignore_eos": True}
        sock = await open_raw(server.port, MESSAGES, body, rcvbuf=4096)
        await until(lambda: any(r.outcome == "stall" for r in records), within=20)
        await until(lambda: engine.statistics().active == 0, within=2)
        assert engine.statistics().aborts_by_cause.get("stall") == 1
        assert engine.statistics().generated_tokens < 1000
        sock.close()
        r = await client.post(MESSAGES, json={"model": "model", "max_tokens": 2, "messages": USER})
        assert r.status_code == 200 and not server.app.pump.streams


async def test_a_final_assistant_turn_is_a_prefill_the_answer_continues(tiny_model_fp32):
    """Anthropic's prefill: the answer continues the trailing assistant text (no end of turn,
    no new assistant header), holds only the continuation, and is counted the same way."""
    prefilled = [*USER, {"role": "assistant", "content": "Sure, the answer is"}]

    def call(url: str) -> tuple[anthropic.types.Message, int]:
        client = sdk(url)
        msg = client.messages.create(model="model", max_tokens=6, messages=prefilled,
                                     extra_body={**GREEDY, "ignore_eos": True})
        return msg, client.messages.count_tokens(model="model", messages=prefilled).input_tokens

    async with serve(tiny_model_fp32) as server, server.client() as client:
        msg, counted = await trio.to_thread.run_sync(call, server.url)
        engine = server.engine
        prompt = engine.encode_prompt("chat", prefilled, {"continue_final_message": True})
        closed = engine.encode_prompt("chat", prefilled)
        # The same ids as a raw completion: the model continues exactly that text.
        r = await client.post("/v1/completions", json={"model": "model", "prompt": prompt, "max_tokens": 6,
                                                       "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        completion = r.json()["choices"][0]["text"]

        async def refused(messages, **extra) -> str:
            r = await client.post(MESSAGES, json={"model": "model", "max_tokens": 4, "messages": messages, **extra})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["type"] == "invalid_request_error"
            return r.json()["error"]["message"]

        assert "trailing whitespace" in await refused([*USER, {"role": "assistant", "content": "Sure "}])
        call_block = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
        assert "text only" in await refused([*USER, {"role": "assistant", "content": [call_block]}])
        schema = {"type": "object"}
        # in this API's names (it said `continue_final_message` and `response_format`)
        for extra in ({"output_config": {"format": {"type": "json_schema", "schema": schema}}},
                      {"tools": [{"name": "f", "input_schema": schema}], "tool_choice": {"type": "any"}}):
            said = await refused(prefilled, **extra)
            assert "mid-message" in said and "output_config.format" in said, said
            assert "continue_final_message" not in said and "response_format" not in said, said
    text = engine.tokenizer.decode(prompt)
    assert text.endswith("assistant\nSure, the answer is") and len(prompt) < len(closed)
    assert msg.usage.input_tokens == len(prompt) == counted
    assert msg.content[0].text == completion and msg.usage.output_tokens == 6
