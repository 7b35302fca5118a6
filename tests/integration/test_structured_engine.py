"""Tools and response formats through the channel API: the engine compiles, the actor enforces.

The models are random-weight tiny llamas: left alone they write garbage and
never stop, so every valid JSON answer and every call below is the grammar's
doing, inside the actor's shared batch.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import trio
from tool_schemas import ASK, WEATHER_DESCRIPTION, chat_tool, search_parameters, weather_parameters

import trio_mlx
from trio_mlx import Finished, InvalidRequestError, TextDelta, ToolCall, ToolCallDelta, ToolCalls

pytestmark = pytest.mark.timeout(90)

WEATHER = chat_tool("get_weather", weather_parameters(20), WEATHER_DESCRIPTION)
SEARCH = chat_tool("search", search_parameters(closed=False))
TOOLS = [WEATHER, SEARCH]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


async def collect(stream: trio_mlx.RequestStream) -> tuple[str, list[ToolCall], Finished]:
    text: list[str] = []
    calls: list[ToolCall] = []
    async for ev in stream:
        if isinstance(ev, TextDelta):
            text.append(ev.text)
        elif isinstance(ev, ToolCalls):
            calls.extend(ev.calls)
        elif isinstance(ev, Finished):  # ToolCallDeltas: the same calls, in pieces
            return "".join(text), calls, ev
    raise AssertionError("no Finished event")


def schema_of(name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
async def test_required_tool_choice_always_makes_valid_calls(tool_model_fp32: Path, temperature: float) -> None:
    async with trio_mlx.open_engine(tool_model_fp32, warmup=False) as engine:
        for i in range(3):
            async with engine.chat(ASK, tools=TOOLS, tool_choice="required", max_tokens=80,
                                   temperature=temperature, seed=i) as events:
                text, calls, fin = await collect(events)
            assert calls, (text, fin)
            assert fin.finish_reason in ("tool_calls", "length")
            assert "<tool_call>" not in text and "</tool_call>" not in text
            for n, call in enumerate(calls):
                assert call.index == n and call.id.startswith("call_")
                jsonschema.validate(json.loads(call.arguments), schema_of(call.name))


async def test_calls_stream_as_deltas_that_join_into_the_whole_calls(tool_model_fp32: Path) -> None:
    """The channel API's ToolCallDeltas: per call a header (index, id, name, arguments ""),
    then fragments, all before the ToolCalls event that carries the call whole; the
    fragments join into its arguments exactly, in more than one piece."""
    async with trio_mlx.open_engine(tool_model_fp32, warmup=False) as engine:
        for i in range(3):
            async with engine.chat(ASK, tools=TOOLS, tool_choice="required", max_tokens=80,
                                   temperature=1.0, seed=i) as events:
                seen = [ev async for ev in events]
            deltas = [ev for ev in seen if isinstance(ev, ToolCallDelta)]
            calls = [c for ev in seen if isinstance(ev, ToolCalls) for c in ev.calls]
            assert calls and isinstance(seen[-1], Finished)
            for call in calls:
                mine = [d for d in deltas if d.index == call.index]
                assert mine[0].arguments == "" and {(d.id, d.name) for d in mine} == {(call.id, call.name)}
                assert "".join(d.arguments for d in mine) == call.arguments and len(mine) > 2
                whole_at = next(n for n, ev in enumerate(seen) if isinstance(ev, ToolCalls) and call in ev.calls)
                assert seen.index(mine[-1]) < whole_at
                jsonschema.validate(json.loads(call.arguments), schema_of(call.name))


async def test_named_tool_choice_calls_that_function(tool_model_fp32: Path) -> None:
    async with trio_mlx.open_engine(tool_model_fp32, warmup=False) as engine:
        choice = {"type": "function", "function": {"name": "search"}}
        async with engine.chat(ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                               max_tokens=60, temperature=0) as events:
            text, calls, fin = await collect(events)
    assert [c.name for c in calls] == ["search"] and fin.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0].arguments), schema_of("search"))


async def test_history_with_calls_and_results_renders(tool_model_fp32: Path) -> None:
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    async with trio_mlx.open_engine(tool_model_fp32, warmup=False) as engine:
        async with engine.chat(history, tools=TOOLS, max_tokens=4, temperature=0) as events:
            await collect(events)
            prompt = engine.tokenizer.decode(events.prompt_tokens)
    assert "get_weather" in prompt and "sunny" in prompt and '"city": "Paris"' in prompt


async def test_tool_choice_none_leaves_tools_out(tool_model_fp32: Path) -> None:
    async with trio_mlx.open_engine(tool_model_fp32, warmup=False) as engine:
        async with engine.chat(ASK, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0) as events:
            _, calls, fin = await collect(events)
            prompt = engine.tokenizer.decode(events.prompt_tokens)
    assert "get_weather" not in prompt and not calls and fin.finish_reason == "length"


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
async def test_a_batch_of_16_mixed_rows_all_validate(tiny_model_fp32: Path, temperature: float) -> None:
    """Constrained and free rows in one batch: every constrained output validates,
    every free row runs to its max_tokens."""
    results: dict[int, tuple[str, Finished]] = {}
    formats = [SCHEMA_FORMAT, {"type": "json_object"}]

    async def one(engine: trio_mlx.Engine, i: int) -> None:
        fmt = formats[i // 2 % 2] if i % 2 == 0 else None
        async with engine.generate(f"prompt {i}", response_format=fmt, max_tokens=60 + i,
                                   temperature=temperature, seed=i) as events:
            text, _, fin = await collect(events)
        results[i] = (text, fin)

    async with trio_mlx.open_engine(tiny_model_fp32, warmup=False, max_batch=16) as engine:
        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(one, engine, i)
        assert engine.statistics().step_failures == 0
    for i, (text, fin) in results.items():
        if i % 2:
            assert fin.finish_reason == "length" or temperature > 0
            continue
        value = json.loads(text)
        if i // 2 % 2 == 0:
            jsonschema.validate(value, PERSON)
        else:
            assert isinstance(value, dict)
        assert fin.finish_reason in ("stop", "length") and fin.usage.completion_tokens <= 60 + i


async def test_turns_one_at_a_time_compile_their_grammar_once(tiny_model_fp32: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A client whose requests come one at a time (an agent's turns) starts every row from one
    compiled matcher of its grammar, however many threads llguidance's pool has: a row that
    ended frees its start (the actor drops its processor), so no second one is built. Rows
    alive together spread over starts of their own (`_constrain.LEXERS` at most)."""
    from trio_mlx.actor import _constrain

    monkeypatch.setattr(_constrain, "LEXERS", 4)
    monkeypatch.setattr(_constrain, "_STARTS", weakref.WeakKeyDictionary())  # none kept by earlier tests
    built: list[int] = []
    real = _constrain.llguidance.LLMatcher

    class Counted:  # llguidance.LLMatcher, its builds counted
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            built.append(1)
            return real(*args, **kwargs)

        grammar_from_json_schema = staticmethod(real.grammar_from_json_schema)

    monkeypatch.setattr(_constrain.llguidance, "LLMatcher", Counted)
    async with trio_mlx.open_engine(tiny_model_fp32, warmup=False, max_batch=8) as engine:
        for turn in range(3):
            async with engine.chat(ASK, response_format=SCHEMA_FORMAT, max_tokens=70, temperature=0,
                                   seed=turn) as events:
                text, _, _ = await collect(events)
            jsonschema.validate(json.loads(text), PERSON)
        assert len(built) == 1

        async def one(i: int) -> None:
            async with engine.chat(ASK, response_format=SCHEMA_FORMAT, max_tokens=70, temperature=1.0,
                                   seed=i) as events:
                jsonschema.validate(json.loads((await collect(events))[0]), PERSON)

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(one, i)
    assert 1 < len(built) <= 4


async def test_response_format_through_the_process_actor(tiny_model_fp32: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_fp32, warmup=False, actor="process") as engine:
        async with engine.chat(ASK, response_format=SCHEMA_FORMAT, max_tokens=70, temperature=0) as events:
            text, _, fin = await collect(events)
    jsonschema.validate(json.loads(text), PERSON)
    assert fin.finish_reason in ("stop", "length")


async def test_again_reuses_the_grammar_for_more_choices(tiny_model_fp32: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_fp32, warmup=False) as engine:
        async with engine.chat(ASK, response_format=SCHEMA_FORMAT, max_tokens=70, temperature=1.0, seed=1) as first:
            async with first.again(seed=2) as second:
                assert second.prompt_tokens == first.prompt_tokens and second.grammar is first.grammar
                for stream in (first, second):
                    text, _, _ = await collect(stream)
                    jsonschema.validate(json.loads(text), PERSON)


async def test_a_failing_processor_fails_only_its_row(tiny_model_fp32: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_mlx.actor import _constrain

    real = _constrain.GrammarProcessor._advance

    def broken(self: Any, token: int | None, *rest: Any) -> bool:
        if self._max_tokens == 33:  # the row to break
            raise RuntimeError("injected")
        return real(self, token, *rest)

    monkeypatch.setattr(_constrain.GrammarProcessor, "_advance", broken)
    async with trio_mlx.open_engine(tiny_model_fp32, warmup=False) as engine:
        out: dict[int, Finished] = {}

        async def one(max_tokens: int, fmt: Any) -> None:
            async with engine.generate("hello", response_format=fmt, max_tokens=max_tokens, temperature=0) as ev:
                out[max_tokens] = (await collect(ev))[2]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 33, {"type": "json_object"})
            nursery.start_soon(one, 34, {"type": "json_object"})
            nursery.start_soon(one, 20, None)
    assert out[33].finish_reason == "error" and "injected" in (out[33].error or "")
    assert out[34].finish_reason in ("stop", "length") and out[20].finish_reason == "length"


@pytest.mark.parametrize("options,param,needle", [
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}),
     "response_format", "schema"),
    (dict(response_format={"type": "xml"}), "response_format", "json_schema"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0]", "name"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format", "both"),
    (dict(response_format={"type": "json_object"}, max_tokens=1), "max_tokens", "at least"),
    # past llguidance's limits within a few tokens (they failed mid-answer, as a 500), or no output at all
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "^(a{1000}){1000}$"}}}),
     "response_format", "cannot be enforced"),
    (dict(response_format={"type": "json_schema", "json_schema": {"strict": True, "schema": {
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}), "response_format", "cannot be enforced"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}),
     "response_format", "cannot be enforced"),
])
async def test_bad_structure_is_a_clear_error(tool_model_fp32: Path, options: dict[str, Any], param: str,
                                              needle: str) -> None:
    async with trio_mlx.open_engine(tool_model_fp32, warmup=False) as engine:
        with pytest.raises(InvalidRequestError) as info:
            async with engine.chat(ASK, **options):
                pass
        assert engine.statistics().requests_submitted == 0
    assert info.value.param == param and needle in info.value.message


async def test_tools_for_a_model_without_tool_calling_is_a_clear_error(tiny_model_fp32: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_fp32, warmup=False) as engine:
        with pytest.raises(InvalidRequestError) as info:
            async with engine.chat(ASK, tools=TOOLS):
                pass
    assert info.value.param == "tools" and "does not support tool calling" in info.value.message


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
async def test_tools_beside_a_response_format_give_calls_or_an_answer(tool_model_fp32: Path,
                                                                       temperature: float) -> None:
    """tool_choice "auto" with a JSON response format: every reply is valid calls or a
    valid answer, never free text."""
    kinds = set()
    async with trio_mlx.open_engine(tool_model_fp32, warmup=False) as engine:
        for i in range(8):
            async with engine.chat(ASK, tools=TOOLS, response_format=SCHEMA_FORMAT, max_tokens=90,
                                   temperature=temperature, seed=i) as events:
                text, calls, fin = await collect(events)
            if calls:
                assert not text.strip() and fin.finish_reason in ("tool_calls", "length")
                for call in calls:
                    jsonschema.validate(json.loads(call.arguments), schema_of(call.name))
                kinds.add("calls")
            else:
                jsonschema.validate(json.loads(text), PERSON)
                kinds.add("answer")
    # greedy, this model always answers; sampled (seeded), it does both: the grammar admits either
    assert kinds == ({"answer"} if temperature == 0.0 else {"answer", "calls"})


async def test_a_grammar_ends_on_eos_even_with_ignore_eos(tiny_model_fp32: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_fp32, warmup=False) as engine:
        async with engine.generate("x", response_format={"type": "json_object"}, max_tokens=200,
                                   ignore_eos=True, temperature=0) as events:
            text, _, fin = await collect(events)
    assert isinstance(json.loads(text), dict)
    assert fin.finish_reason == "stop" and fin.usage.completion_tokens < 200


async def test_a_text_no_completion_fits_ends_as_length_not_stop(tiny_model_fp32: Path) -> None:
    """A schema whose shortest answer is longer than max_tokens: the row is cut at max_tokens
    with its JSON unfinished, so it ends "length" (a client reads "stop" as "the JSON is
    whole"), whether or not the processor found a completion to measure."""
    long_string = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "minLength": 500}}}
    async with trio_mlx.open_engine(tiny_model_fp32, warmup=False) as engine:
        async with engine.chat(ASK, response_format=long_string, max_tokens=20, temperature=0) as events:
            text, _, fin = await collect(events)
    assert fin.usage.completion_tokens <= 20 and text.startswith('"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert fin.finish_reason == "length"
