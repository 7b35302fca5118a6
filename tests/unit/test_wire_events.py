"""The two APIs' response bodies and event streams, made from scripted engine events and read by
the official SDKs (over an httpx mock transport, no server): every field validates against the
SDK's own types, and the SDKs' stream helpers rebuild the same message / response.

Reasoning text (`TextDelta.reasoning`, from models whose family marks it) is covered here: the
tiny test models have no thinking tokens."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx2  # the SDKs' own HTTP client package
import openai
import pytest
from openai.types.responses import Response

from trio_mlx.engine import Finished, TextDelta, ToolCall, ToolCallDelta, ToolCalls, Usage
from trio_mlx.server._http import HTTPError
from trio_mlx.server._pump import ChoiceResult
from trio_mlx.server.anthropic._protocol import MessagesRequest
from trio_mlx.server.anthropic._serving import MessagesCall
from trio_mlx.server.responses._protocol import ResponsesRequest
from trio_mlx.server.responses._serving import ResponsesCall

# The anthropic SDK is imported by the first test (conftest.py's anthropic_sdk: once per worker
# that runs this module, and frozen out of the collector's walks), not at collection.
pytestmark = pytest.mark.usefixtures("anthropic_sdk")
CALL = ToolCall(0, "call_1", "get_weather", '{"city":"Paris"}')
SCRIPT: list[Any] = [TextDelta("", (1,), reasoning="Let me "), TextDelta("", (2,), reasoning="think."),
                     TextDelta("Checking", (3,)), TextDelta(" now.", (4,)), ToolCalls((CALL,)),
                     Finished("tool_calls", Usage(11, 9))]
# The same answer with its call streamed as the engine streams a JSON-format call: the header,
# then argument fragments that join into CALL.arguments, then the whole call.
FRAGMENTS = ("", '{"city"', ':"Par', 'is"}')
STREAMED: list[Any] = [*SCRIPT[:4], *(ToolCallDelta(0, "call_1", "get_weather", f) for f in FRAGMENTS),
                       *SCRIPT[4:]]
# A streamed call the parser then refused: no whole call; its text follows as content.
REFUSED: list[Any] = [TextDelta("Checking", (3,)), ToolCallDelta(0, "call_1", "get_weather", ""),
                      ToolCallDelta(0, "call_1", "get_weather", '{"city":'), TextDelta('{"city": }}', (4,)),
                      Finished("stop", Usage(11, 9))]
TEXT_ONLY: list[Any] = [TextDelta("Hello", (1,)), TextDelta(" there", (2,)), Finished("length", Usage(5, 2))]


def result_of(events: Sequence[Any]) -> ChoiceResult:
    r = ChoiceResult()
    for ev in events:
        r.take(ev)  # as the pump collects a whole answer
    return r


def stream_body(enc: Any, events: Sequence[Any]) -> bytes:
    return enc.start() + b"".join(enc.event(ev) for ev in events[:-1]) + enc.finish(events[-1])


def mock(body: bytes, sse: bool) -> httpx2.Client:
    ctype = "text/event-stream" if sse else "application/json"
    return httpx2.Client(transport=httpx2.MockTransport(
        lambda request: httpx2.Response(200, content=body, headers={"content-type": ctype})))


def anthropic_message(body: bytes) -> Any:
    """`body` read as the Anthropic SDK's Message (the SDK is loaded already: pytestmark)."""
    from anthropic.types import Message

    return Message.model_validate(json.loads(body))


def anthropic_stream(body: bytes) -> tuple[list[Any], Any]:
    """The Anthropic SDK's stream helper over `body`: its events, and the message it rebuilds."""
    import anthropic

    client = anthropic.Anthropic(base_url="http://x", api_key="k", http_client=mock(body, True))
    with client.messages.stream(model="m", max_tokens=20, messages=[{"role": "user", "content": "hi"}]) as s:
        return list(s), s.get_final_message()


TOOLS = [{"name": "get_weather", "input_schema": {"type": "object"}}]


def anthropic_call(**kw: Any) -> MessagesCall:
    return MessagesCall(MessagesRequest.model_validate({"model": "m", "max_tokens": 20, "messages": [
        {"role": "user", "content": "hi"}], **kw}))


def test_anthropic_whole_and_streamed_with_thinking_text_and_a_tool_call():
    call = anthropic_call(tools=TOOLS)
    whole = anthropic_message(call.whole("msg_1", "m", result_of(SCRIPT)))
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"]
    assert whole.content[0].thinking == "Let me think." and whole.content[1].text == "Checking now."
    assert whole.content[2].input == {"city": "Paris"} and whole.content[2].id == "call_1"
    assert whole.stop_reason == "tool_use" and whole.usage.input_tokens == 11 and whole.usage.output_tokens == 9

    body = stream_body(call.encoder("msg_1", "m", 11), SCRIPT)
    events, final = anthropic_stream(body)
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1, 2]


def test_anthropic_text_only_ends_at_max_tokens_and_errors_have_its_shape():
    call = anthropic_call()
    whole = anthropic_message(call.whole("msg_1", "m", result_of(TEXT_ONLY)))
    assert [b.type for b in whole.content] == ["text"] and whole.stop_reason == "max_tokens"
    enc = call.encoder("msg_1", "m", 5)
    body = stream_body(enc, TEXT_ONLY)
    assert anthropic_stream(body)[1].model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    # An empty answer still has one (empty) text block, as the whole response does.
    empty = [Finished("stop", Usage(5, 1))]
    body = stream_body(call.encoder("msg_1", "m", 5), empty)
    _, final = anthropic_stream(body)
    assert [(b.type, b.text) for b in final.content] == [("text", "")] and final.stop_reason == "end_turn"
    error = call.encoder("msg_1", "m", 5).error(HTTPError(500, "boom"))
    assert error.startswith(b"event: error\ndata: ")
    assert json.loads(error.split(b"data: ", 1)[1]) == {"type": "error", "error": {"type": "api_error",
                                                                                    "message": "boom"}}


def responses_call(**kw: Any) -> ResponsesCall:
    return ResponsesCall(ResponsesRequest.model_validate({"input": "hi", **kw}))


def strip(r: Response) -> Any:
    """A response without its ids (item ids are minted per answer) and what the SDK's stream
    helper adds (`parsed`, `parsed_arguments`)."""
    out = r.model_dump(exclude={"id"}, exclude_none=True)
    for item in out["output"]:
        item.pop("id", None)
        item.pop("parsed_arguments", None)
        for part in item.get("content") or ():
            part.pop("parsed", None)
    return out


def responses_stream(body: bytes) -> Response:
    client = openai.OpenAI(base_url="http://x/v1", api_key="k", http_client=mock(body, True))
    with client.responses.stream(model="m", input="hi") as s:
        list(s)
        return s.get_final_response()


def test_text_after_a_call_keeps_its_place_whole_as_streamed():
    """A call, then text: the stream sends them in that order, and the whole answer (which put
    all text first) now does too, on both APIs."""
    events = [TextDelta("Checking", (3,)), ToolCalls((CALL,)), TextDelta(" done", (4,)), TextDelta(".", (5,)),
              Finished("tool_calls", Usage(11, 9))]
    call = anthropic_call(tools=TOOLS)
    whole = anthropic_message(call.whole("msg_1", "m", result_of(events)))
    assert [(b.type, getattr(b, "text", None)) for b in whole.content] == [
        ("text", "Checking"), ("tool_use", None), ("text", " done.")]
    _, final = anthropic_stream(stream_body(call.encoder("msg_1", "m", 11), events))
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    call2 = responses_call(tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}])
    whole2 = Response.model_validate(json.loads(call2.whole("resp_1", "m", result_of(events))))
    assert [o.type for o in whole2.output] == ["message", "function_call", "message"]
    assert strip(responses_stream(stream_body(call2.encoder("resp_1", "m", 11), events))) == strip(whole2)


def test_responses_whole_and_streamed_with_reasoning_text_and_a_call():
    call = responses_call(tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}])
    whole = Response.model_validate(json.loads(call.whole("resp_1", "m", result_of(SCRIPT))))
    assert [o.type for o in whole.output] == ["reasoning", "message", "function_call"]
    assert whole.output[0].content[0].text == "Let me think." and whole.output_text == "Checking now."
    fc = whole.output[2]
    assert (fc.call_id, fc.name, fc.arguments, fc.status) == ("call_1", "get_weather", '{"city":"Paris"}', "completed")
    assert whole.status == "completed" and whole.usage.total_tokens == 20 and whole.store is False
    # left to the model's defaults: null, not OpenAI's 1.0 (the model's generation_config rules)
    assert whole.temperature is None and whole.top_p is None
    assert responses_call(temperature=0.3).response("resp_1", "m", "completed", [])["temperature"] == 0.3

    body = stream_body(call.encoder("resp_1", "m", 11), SCRIPT)
    client = openai.OpenAI(base_url="http://x/v1", api_key="k", http_client=mock(body, True))
    with client.responses.stream(model="m", input="hi") as s:
        events = list(s)
        final = s.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert strip(final) == strip(whole)
    kinds = [e.type for e in events]
    assert kinds.count("response.reasoning_text.delta") == 2 and kinds.count("response.output_text.delta") == 2
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done == ["reasoning", "message", "function_call"]


def test_responses_incomplete_and_failed():
    call = responses_call(max_output_tokens=2)
    whole = Response.model_validate(json.loads(call.whole("resp_1", "m", result_of(TEXT_ONLY))))
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text == "Hello there" and whole.max_output_tokens == 2
    body = stream_body(call.encoder("resp_1", "m", 5), TEXT_ONLY)
    client = openai.OpenAI(base_url="http://x/v1", api_key="k", http_client=mock(body, True))
    events = list(client.responses.create(model="m", input="hi", stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == "Hello there"
    enc = call.encoder("resp_1", "m", 5)
    body = enc.start() + enc.event(TEXT_ONLY[0]) + enc.error(HTTPError(503, "aborted", code="aborted"))
    client = openai.OpenAI(base_url="http://x/v1", api_key="k", http_client=mock(body, True))
    events = list(client.responses.create(model="m", input="hi", stream=True))
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-2].code == "aborted" and events[-1].response.error.message == "aborted"
    # the message being written was closed, incomplete, and the failed response holds its text
    # (it was left open, and response.failed said output [] after text deltas went out)
    assert [e.type for e in events].count("response.output_item.done") == 1
    failed = events[-1].response.output
    assert [(o.type, o.status, o.content[0].text) for o in failed] == [("message", "incomplete", "Hello")]


def test_anthropic_streams_a_call_in_input_json_fragments():
    """One tool_use block opened with the id, name and an empty input, one input_json_delta
    per fragment; the SDK's stream helper rebuilds the whole message."""
    call = anthropic_call(tools=TOOLS)
    whole = anthropic_message(call.whole("msg_1", "m", result_of(STREAMED)))
    body = stream_body(call.encoder("msg_1", "m", 11), STREAMED)
    events, final = anthropic_stream(body)
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    assert final.content[2].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["thinking", "text", "tool_use"] and starts[2].input == {}
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"
               and e.delta.type == "input_json_delta"]
    assert partial == list(FRAGMENTS[1:])
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1, 2]


def test_anthropic_a_refused_streamed_call_closes_and_its_text_follows():
    body = stream_body(anthropic_call(tools=TOOLS).encoder("msg_1", "m", 11), REFUSED)
    events, final = anthropic_stream(body)
    assert [b.type for b in final.content] == ["text", "tool_use", "text"]
    assert final.content[2].text == '{"city": }}' and final.stop_reason == "end_turn"
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1, 2]


def test_responses_streams_a_call_in_argument_fragments():
    """The function_call item is added with the name and empty arguments, each fragment is a
    function_call_arguments.delta; the SDK's stream helper rebuilds the whole response."""
    call = responses_call(tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}])
    whole = Response.model_validate(json.loads(call.whole("resp_1", "m", result_of(STREAMED))))
    body = stream_body(call.encoder("resp_1", "m", 11), STREAMED)
    client = openai.OpenAI(base_url="http://x/v1", api_key="k", http_client=mock(body, True))
    with client.responses.stream(model="m", input="hi") as s:
        events = list(s)
        final = s.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    fc = final.output[2]
    assert (fc.type, fc.call_id, fc.name, fc.arguments, fc.status) == (
        "function_call", "call_1", "get_weather", '{"city":"Paris"}', "completed")
    assert fc.model_dump(exclude={"id", "parsed_arguments"}) == whole.output[2].model_dump(exclude={"id"})
    assert final.status == whole.status and final.usage == whole.usage
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert added[2].type == "function_call" and added[2].arguments == "" and added[2].name == "get_weather"
    assert [e.delta for e in events if e.type == "response.function_call_arguments.delta"] == list(FRAGMENTS[1:])
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == '{"city":"Paris"}' and done.item_id == added[2].id


def test_responses_a_refused_streamed_call_is_incomplete_and_its_text_follows():
    call = responses_call(tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}])
    body = stream_body(call.encoder("resp_1", "m", 11), REFUSED)
    client = openai.OpenAI(base_url="http://x/v1", api_key="k", http_client=mock(body, True))
    events = list(client.responses.create(model="m", input="hi", stream=True))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [(o.type, o.status) for o in final.output] == [
        ("message", "completed"), ("function_call", "incomplete"), ("message", "completed")]
    assert final.output[1].arguments == '{"city":' and final.output[2].content[0].text == '{"city": }}'
