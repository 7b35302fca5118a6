"""OpenAI's Responses API (`/v1/responses`) against a real server, through the official `openai`
SDK's `client.responses` (in a worker thread) and raw HTTP."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest
import trio
from app_server import assert_error, engine_factory, serve, slow_steps
from tool_schemas import ASK_TEXT, WEATHER_DESCRIPTION, search_parameters, weather_parameters

from integration.test_app_cancel import assert_disconnects_free_the_slot

RESPONSES = "/v1/responses"
ASK = ASK_TEXT
WEATHER = {"type": "function", "name": "get_weather", "description": WEATHER_DESCRIPTION,
           "parameters": weather_parameters(20)}
SEARCH = {"type": "function", "name": "search", "parameters": search_parameters(closed=False)}


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=20)


def text_calls(url: str) -> dict:
    client = sdk(url)
    out: dict = {}
    kw = dict(model="model", instructions="Be terse.", max_output_tokens=6, temperature=0)
    out["whole"] = client.responses.create(input="Hello there", **kw)
    out["events"] = list(client.responses.create(input="Hello there", stream=True, **kw))
    with client.responses.stream(input=[{"role": "user", "content": "Hello there"}], **kw) as stream:
        helper = list(stream)  # the SDK's accumulating helper accepts the event sequence
        out["helper_text"] = "".join(e.delta for e in helper if e.type == "response.output_text.delta")
        out["helper_last"] = helper[-1]
    return out


async def test_text_response_whole_and_streamed(tiny_model_fp32):
    async with serve(tiny_model_fp32) as server:
        out = await trio.to_thread.run_sync(text_calls, server.url)
        prompt = server.engine.encode_prompt("chat", [{"role": "system", "content": "Be terse."},
                                                      {"role": "user", "content": "Hello there"}])
    whole = out["whole"]
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == "model"
    assert [o.type for o in whole.output] == ["message"]
    assert whole.usage.input_tokens == len(prompt) and 1 <= whole.usage.output_tokens <= 6
    assert whole.status == ("incomplete" if whole.usage.output_tokens == 6 else "completed")
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"
    events = out["events"]
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    # Greedy: the stream says what the whole response said.
    assert streamed == whole.output_text == events[-4].text == out["helper_text"]
    final = events[-1].response
    assert final.output_text == streamed and final.usage.output_tokens == whole.usage.output_tokens
    # At max_output_tokens OpenAI ends with response.incomplete (the SDK's get_final_response()
    # wants response.completed, as with OpenAI's own service).
    assert out["helper_last"].type == f"response.{whole.status}"
    assert out["helper_last"].response.output_text == streamed


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=12)
    days: int = pydantic.Field(ge=1, le=7)


def tool_calls(url: str) -> dict:
    client = sdk(url)
    out: dict = {}
    kw = dict(model="model", max_output_tokens=60, temperature=0, tools=[WEATHER, SEARCH])
    out["required"] = client.responses.create(input=ASK, tool_choice="required", **kw)
    events = list(client.responses.create(input=ASK, tool_choice={"type": "function", "name": "get_weather"},
                                          stream=True, **kw))
    out["events"] = events
    call = next(o for o in events[-1].response.output if o.type == "function_call")
    history = [{"role": "user", "content": ASK}, *[o.model_dump(exclude_none=True) for o in events[-1].response.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    out["reply"] = client.responses.create(input=history, tool_choice="none", **kw)
    out["parsed"] = client.responses.parse(model="model", input="A city?", text_format=City, max_output_tokens=60,
                                           temperature=0)
    out["json"] = client.responses.create(model="model", input="JSON please", max_output_tokens=40,
                                          text={"format": {"type": "json_object"}})
    return out


async def test_function_calls_round_trip_and_structured_output(tool_model_fp32):
    async with serve(tool_model_fp32) as server:
        out = await trio.to_thread.run_sync(tool_calls, server.url)
    calls = [o for o in out["required"].output if o.type == "function_call"]
    assert calls and not [o for o in out["required"].output if o.type == "message"]
    for c in calls:
        assert c.call_id and c.id.startswith("fc_") and c.status == "completed"
        jsonschema.validate(json.loads(c.arguments), (WEATHER if c.name == "get_weather" else SEARCH)["parameters"])
    events = out["events"]
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == "".join(e.arguments for e in done)
    assert types.count("response.function_call_arguments.delta") > len(done)  # streamed in fragments
    final = events[-1].response
    named = [o for o in final.output if o.type == "function_call"]
    assert named and all(o.name == "get_weather" for o in named)
    jsonschema.validate(json.loads(named[0].arguments), WEATHER["parameters"])
    reply = out["reply"]
    assert [o.type for o in reply.output] == ["message"] and reply.usage.input_tokens > 0
    parsed = out["parsed"]
    assert isinstance(parsed.output_parsed, City)  # the SDK validated it against the pydantic model
    assert isinstance(json.loads(out["json"].output_text), dict)


async def test_errors_are_clear_400s_in_openais_shape(tiny_model_fp32, tool_model_fp32):
    async with serve(tiny_model_fp32) as server, server.client() as client:
        async def bad(body, param, status=400):
            return assert_error(await client.post(RESPONSES, json={"input": "hi", **body}), status, param=param)

        assert "keeps no responses" in (await bad({"previous_response_id": "resp_1"}, "previous_response_id"))[
            "message"]
        assert "store" in (await bad({"store": True}, "store"))["message"]
        await bad({"conversation": "conv_1"}, "conversation")
        await bad({"tool_choice": "required"}, "tool_choice")
        img = {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}
        msg = (await bad({"input": [img]}, "input.0.content.0"))["message"]
        assert "reads text only" in msg
        await bad({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0")
        await bad({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema")
        await bad({"max_output_tokens": 0}, "max_output_tokens")
        # a call's arguments that are not JSON, at the item's own place (it said input.tool_calls[0])
        call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{not json"}
        msg = (await bad({"input": [{"role": "user", "content": "hi"}, call]}, "input.1.arguments"))["message"]
        assert msg.startswith("input.1.arguments: not JSON"), msg
        await bad({"model": "gpt-5"}, "model", 404)
        assert (await client.post(RESPONSES, json={"input": "hi", "store": False, "max_output_tokens": 2})
                ).status_code == 200
    async with serve(tool_model_fp32) as server, server.client() as client:
        body = {"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}
        assert "nope" in assert_error(await client.post(RESPONSES, json=body), 400, param="tool_choice")["message"]
        body = {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                   "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}}
        err = assert_error(await client.post(RESPONSES, json=body), 400)
        # The engine's names (response_format, max_tokens, messages) come back as this API's.
        assert err["param"].startswith("text.format") and "response_format" not in err["message"], err
        err = assert_error(await client.post(RESPONSES, json={"input": "word " * 3000}), 400)
        assert err["param"] == "input" and err["code"] == "context_length_exceeded", err
        err = assert_error(await client.post(RESPONSES, json={"input": "hi", "max_output_tokens": 5000}), 400)
        assert err["param"] == "input" and "5000" in err["message"], err


async def test_disconnect_mid_stream_frees_the_slot(tiny_model_fp32):
    body = {"input": "hi", "max_output_tokens": 900, "ignore_eos": True}
    await assert_disconnects_free_the_slot(tiny_model_fp32, RESPONSES, body)


@pytest.mark.parametrize("path", [RESPONSES, "/v1/messages"])
async def test_a_stream_the_engine_fails_ends_with_an_error_event(tiny_model_fp32, path):
    """A step that raises mid-stream: the stream's last events say so, in the API's shape."""
    state = {"steps": 0}

    def hook(stage: str) -> None:
        if stage == "step":
            state["steps"] += 1
            if state["steps"] == 4:
                raise RuntimeError("injected")

    async with serve(tiny_model_fp32, factory=engine_factory(fault_hook=hook)) as server, server.client() as client:
        body = ({"input": "hi", "max_output_tokens": 50, "stream": True, "ignore_eos": True} if path == RESPONSES else
                {"model": "model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True,
                 "ignore_eos": True})
        r = await client.post(path, json=body)
        assert r.status_code == 200
        events = [e for e in r.text.strip().split("\n\n") if not e.startswith(":")]
        kinds = [e.split("\n")[0].removeprefix("event: ") for e in events]
        if path == RESPONSES:
            assert kinds[-2:] == ["error", "response.failed"]
            failed = json.loads(events[-1].split("data: ", 1)[1])["response"]
            assert failed["status"] == "failed" and failed["error"]["message"]
        else:
            assert kinds[-1] == "error"
            err = json.loads(events[-1].split("data: ", 1)[1])
            assert err["type"] == "error" and err["error"]["type"] == "api_error"


async def test_the_three_apis_share_the_batch(tiny_model_fp32):
    """Chat, Anthropic and Responses requests decode side by side in one batch; each greedy answer
    is the one it gets alone."""
    bodies = {
        "/v1/chat/completions": lambda i: {"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 12,
                                           "temperature": 0, "ignore_eos": True},
        "/v1/messages": lambda i: {"model": "model", "messages": [{"role": "user", "content": f"q{i}"}],
                                   "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        RESPONSES: lambda i: {"input": f"q{i}", "max_output_tokens": 12, "temperature": 0, "ignore_eos": True},
    }
    text = {
        "/v1/chat/completions": lambda r: r["choices"][0]["message"]["content"],
        "/v1/messages": lambda r: r["content"][0]["text"],
        RESPONSES: lambda r: r["output"][0]["content"][0]["text"],
    }
    cases = [(path, i) for path in bodies for i in range(3)]
    async with serve(tiny_model_fp32, factory=engine_factory(fault_hook=slow_steps(0.002))) as server, \
            server.client() as client:
        async def ask(path: str, i: int) -> str:
            r = await client.post(path, json=bodies[path](i))
            assert r.status_code == 200, r.text
            return text[path](r.json())

        alone = {case: await ask(*case) for case in cases}
        together: dict = {}
        peak = 0

        async def one(case):
            together[case] = await ask(*case)

        async with trio.open_nursery() as nursery:
            for case in cases:
                nursery.start_soon(one, case)
            while len(together) < len(cases):
                peak = max(peak, server.engine.statistics().decoding)
                await trio.sleep(0.001)
    assert together == alone
    assert peak > 3  # requests of different APIs decoded in the same steps
