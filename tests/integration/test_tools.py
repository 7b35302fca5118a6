"""Tests for tool calling: engine/_tools.py, with the tiny test model whose template has tools.

The required-call guarantee is checked the way structured output is: a
random-weight model, driven through mlx-lm's BatchGenerator as the actor
drives it, can only write what the grammar allows.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import mlx.core as mx
import pytest
from batch_driver import Row, run_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.tool_parsers import json_tools, qwen3_coder
from tool_schemas import WEATHER_DESCRIPTION, chat_tool, weather_parameters

from trio_mlx import models
from trio_mlx._errors import InvalidRequestError
from trio_mlx.engine import _tools

pytestmark = pytest.mark.timeout(120)

WEATHER = chat_tool("get_weather", weather_parameters(30, unit=True), WEATHER_DESCRIPTION)
SEARCH = chat_tool("search", {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                            "required": ["query"]})
NOOP = chat_tool("noop")
TOOLS = [WEATHER, SEARCH, NOOP]
MARKUP = ("<tool_call>", "</tool_call>")


@pytest.fixture(scope="module")
def tool_model(tool_model_fp32: Path) -> tuple[Any, Any]:
    model, _ = models.load_model(tool_model_fp32)
    return model, models.load_tokenizer(tool_model_fp32)


def prompt(tok: Any, tools: list[dict[str, Any]], text: str = "What is the weather in Paris?") -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": text}], tools=tools, add_generation_prompt=True))


def parse(tok: Any, tools: list[dict[str, Any]], tokens: list[int], rng: random.Random | None = None) -> list[_tools.ToolDelta]:
    """Stream the row's text through a ToolCallStream in random-sized pieces."""
    ids = [t for t in tokens if t not in tok.eos_token_ids]
    text = tok.decode(ids)
    stream = _tools.ToolCallStream(tok, tools)
    deltas, i = [], 0
    rng = rng or random.Random(0)
    while i < len(text):
        n = rng.randint(1, 12)
        deltas.append(stream.feed(text[i : i + n]))
        i += n
    deltas.append(stream.finish())
    return deltas


def calls_of(deltas: list[_tools.ToolDelta]) -> list[_tools.ToolCall]:
    return [c for d in deltas for c in d.tool_calls]


def test_mlx_lm_recognizes_the_tool_model(tool_model: tuple[Any, Any], tiny_model_fp32: Path) -> None:
    _, tok = tool_model
    assert tok.has_tool_calling and tok.tool_parser is json_tools.parse_tool_call
    assert (tok.tool_call_start, tok.tool_call_end) == MARKUP
    assert len(tok.tool_call_start_tokens) == len(tok.tool_call_end_tokens) == 1  # added tokens
    assert not models.load_tokenizer(tiny_model_fp32).has_tool_calling


def test_the_template_renders_tools_calls_and_results(tool_model: tuple[Any, Any]) -> None:
    _, tok = tool_model
    history = _tools.template_messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ])
    assert history[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 1}
    history[2]["content"] = ""
    text = tok.apply_chat_template(history, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tok.apply_chat_template(history[:2], tokenize=False, add_generation_prompt=True)
    assert "# Tools" not in plain and plain.startswith("<|im_start|>system\nBe brief.<|im_end|>")


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("choice", ["required", "get_weather", "search", "noop"])
def test_an_enforced_choice_always_parses_into_valid_calls(
    tool_model: tuple[Any, Any], choice: str, temperature: float
) -> None:
    """tool_choice "required" or a named function, in a batch with free rows: every
    constrained row's text streams into at least one call, to an allowed function,
    whose arguments validate against its parameters; no markup reaches content."""
    model, tok = tool_model
    tools = _tools.check_tools(TOOLS)
    chosen = _tools.check_tool_choice(choice if choice == "required" else {"type": "function", "function": {"name": choice}}, tools)
    grammar = _tools.tool_grammar(tok, tools, chosen)
    assert grammar is not None and grammar.kind == "tools"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    mx.random.seed(3)
    rows = []
    for i in range(8):
        p = prompt(tok, tools, ["Weather?", "Find cats", "Do nothing", "Hello"][i % 4])
        if i % 4 == 3:
            rows.append(Row(p, 50, temperature=temperature))
        else:
            rows.append(Row(p, grammar.min_tokens + 10 * i, grammar.source, temperature, late=i >= 5))
    run_rows(model, tok, rows)
    for i, row in enumerate(rows):
        if row.grammar is None:
            continue
        deltas = parse(tok, tools, row.tokens, random.Random(i))
        calls = calls_of(deltas)
        assert calls, row.text(tok)
        assert [c.index for c in calls] == list(range(len(calls)))
        assert len({c.id for c in calls}) == len(calls)
        for call in calls:
            assert call.name in schemas and (choice == "required" or call.name == choice)
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        assert all(not d.content and not d.failed for d in deltas), deltas
        assert row.finish_reason == "stop"


def test_parallel_false_allows_exactly_one_call(tool_model: tuple[Any, Any]) -> None:
    model, tok = tool_model
    tools = _tools.check_tools(TOOLS)
    grammar = _tools.tool_grammar(tok, tools, "noop", parallel=False)
    assert grammar is not None
    (row,) = run_rows(model, tok, [Row(prompt(tok, tools), 200, grammar.source)])
    assert [c.name for c in calls_of(parse(tok, tools, row.tokens))] == ["noop"]
    assert row.processor is not None and not row.processor.forced_finish


def test_the_stream_splits_content_from_calls_however_the_text_arrives(tool_model: tuple[Any, Any]) -> None:
    _, tok = tool_model
    text = (
        "Let me check. <tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"query": "<b>rain</b>"}}\n</tool_call>'
    )
    for seed in range(20):
        rng = random.Random(seed)
        stream = _tools.ToolCallStream(tok, TOOLS)
        deltas, i = [], 0
        while i < len(text):
            n = rng.randint(1, 9)
            deltas.append(stream.feed(text[i : i + n]))
            i += n
        deltas.append(stream.finish())
        content = "".join(d.content for d in deltas)
        assert content == "Let me check."  # the space before the call goes with it
        calls = calls_of(deltas)
        assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [
            (0, "get_weather", {"city": "Paris", "days": 2}),
            (1, "search", {"query": "<b>rain</b>"}),
        ]
        assert stream.called


def test_text_without_calls_is_all_content(tool_model: tuple[Any, Any]) -> None:
    _, tok = tool_model
    stream = _tools.ToolCallStream(tok, TOOLS)
    parts = [stream.feed(t) for t in ("Hello", " <tool", "box> and ", "\n", " ")] + [stream.finish()]
    assert "".join(d.content for d in parts) == "Hello <toolbox> and \n "
    assert not stream.called


def test_a_call_left_open_or_broken_is_reported_not_leaked(tool_model: tuple[Any, Any]) -> None:
    _, tok = tool_model
    stream = _tools.ToolCallStream(tok, TOOLS)
    first = stream.feed('<tool_call>\n{"name": "noop", "arguments": {}}')
    end = stream.finish()  # max_tokens cut the markup: the call still counts
    assert not first.tool_calls and [c.name for c in end.tool_calls] == ["noop"]
    stream = _tools.ToolCallStream(tok, TOOLS)
    deltas = [stream.feed('<tool_call>\n{"name": "noop", "argu'), stream.finish()]
    assert not calls_of(deltas) and not any(d.content for d in deltas)
    assert deltas[-1].failed == ('\n{"name": "noop", "argu',)


@pytest.mark.parametrize(
    "tools,needle",
    [
        ([], "non-empty list"),
        ("get_weather", "non-empty list"),
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function must be"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "x" * 129}}], "tools[0].function.name must be 1-128"),
        ([NOOP, NOOP], "two tools are named 'noop'"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "type 'object'"),
    ],
)
def test_a_tool_list_that_is_not_valid_is_a_400(tools: Any, needle: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        _tools.check_tools(tools)
    assert needle in info.value.message and (info.value.param or "").startswith("tools")


def test_a_tool_name_as_long_as_anthropic_allows_is_taken_and_its_call_streams(tool_model: tuple[Any, Any]) -> None:
    """Anthropic's names run to 128 characters (MCP's `mcp__server__tool` run long); the
    engine refused past OpenAI's 64, failing the whole request."""
    name = "mcp__server__" + "t" * 100
    tools = _tools.check_tools([{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}])
    _, tok = tool_model
    deltas = feed_pieces(_tools.ToolCallStream(tok, tools),
                         f'<tool_call>\n{{"name": "{name}", "arguments": {{"q": 1}}}}\n</tool_call>', random.Random(6))
    items = items_of(deltas)
    assert [(c.name, c.arguments) for c in items if type(c) is _tools.ToolCall] == [(name, '{"q": 1}')]
    assert type(items[0]) is _tools.ToolCallDelta and items[0].name == name  # streamed as written


def test_tool_choice(tool_model: tuple[Any, Any]) -> None:
    tools = _tools.check_tools(TOOLS)
    assert _tools.check_tool_choice(None, tools) == "auto"
    assert _tools.check_tool_choice(None, None) == "none"
    assert _tools.check_tool_choice("none", tools) == "none"
    assert _tools.check_tool_choice({"type": "function", "function": {"name": "search"}}, tools) == "search"
    for bad, needle in [
        ({"type": "function", "function": {"name": "launch"}}, "'launch', which is not among the tools"),
        ("sometimes", "tool_choice must be"),
        ({"type": "function"}, "tool_choice must be"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            _tools.check_tool_choice(bad, tools)
        assert needle in info.value.message and info.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError, match="no tools"):
        _tools.check_tool_choice("required", None)
    _, tok = tool_model
    assert _tools.tool_grammar(tok, tools, "auto") is None and _tools.tool_grammar(tok, tools, "none") is None


def test_a_model_without_tool_calling_is_a_clear_400(tiny_model_fp32: Path) -> None:
    tok = models.load_tokenizer(tiny_model_fp32)
    with pytest.raises(InvalidRequestError, match="does not support tool calling") as info:
        _tools.require_tool_support(tok)
    assert info.value.param == "tools"
    with pytest.raises(InvalidRequestError, match="does not support tool calling"):
        _tools.tool_grammar(tok, _tools.check_tools(TOOLS), "required")


def test_a_family_without_a_grammar_refuses_an_enforced_choice(tool_model: tuple[Any, Any]) -> None:
    """tool_choice "required" for a call format with no grammar here: a 400 that says
    so, never a silent unconstrained answer."""
    _, tok = tool_model
    xml = SimpleNamespace(has_tool_calling=True, tool_parser=qwen3_coder.parse_tool_call,
                          tool_call_start="<tool_call>", tool_call_end="</tool_call>")
    with pytest.raises(InvalidRequestError, match=r"cannot be enforced .*\(qwen3_coder\)") as info:
        _tools.tool_grammar(xml, _tools.check_tools(TOOLS), "required")
    assert info.value.param == "tool_choice"


def test_history_with_arguments_that_are_not_json_is_a_400() -> None:
    bad = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(InvalidRequestError, match="not JSON"):
        _tools.template_messages(bad)


# -- streaming a call while it is written ---------------------------------------------------


def feed_pieces(stream: _tools.ToolCallStream, text: str, rng: random.Random, most: int = 9) -> list[_tools.ToolDelta]:
    deltas, i = [], 0
    while i < len(text):
        n = rng.randint(1, most)
        deltas.append(stream.feed(text[i : i + n]))
        i += n
    deltas.append(stream.finish())
    return deltas


def items_of(deltas: list[_tools.ToolDelta]) -> list[Any]:
    return [c for d in deltas for c in d.calls]


def test_a_json_call_streams_its_name_then_argument_fragments_that_join_into_its_arguments(
    tool_model: tuple[Any, Any],
) -> None:
    """However the text is split: the header (index, id, whole name, arguments "") comes
    first, the fragments follow, and joined they are the finished call's arguments
    exactly: a nested object's closing brace, an escaped quote and a brace inside a
    string do not end the arguments early, and "arguments" may come before "name"."""
    _, tok = tool_model
    text = (
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "days": 2, '
        '"opts": {"deep": [1, {"x": "}"}]}}}\n</tool_call>\n'
        '<tool_call>\n{"arguments": {"query": "<b>rain</b>"}, "name": "search"}\n</tool_call>'
    )
    for seed in range(30):
        deltas = feed_pieces(_tools.ToolCallStream(tok, TOOLS), text, random.Random(seed))
        items = items_of(deltas)
        assert "".join(d.content for d in deltas) == "Let me check."
        calls = [c for c in items if type(c) is _tools.ToolCall]
        assert [(c.index, c.name) for c in calls] == [(0, "get_weather"), (1, "search")]
        assert json.loads(calls[0].arguments) == {"city": 'Pa"ris}', "days": 2, "opts": {"deep": [1, {"x": "}"}]}}
        for call in calls:
            mine = [c for c in items if c.index == call.index]
            head, *fragments, whole = mine
            assert type(head) is _tools.ToolCallDelta and head.arguments == "" and head.name == call.name
            assert whole is call and all(type(f) is _tools.ToolCallDelta and f.id == call.id for f in fragments)
            assert "".join(f.arguments for f in fragments) == call.arguments
        first_call = [c for c in items if c.index == 0 and type(c) is _tools.ToolCallDelta and c.arguments]
        assert len(first_call) > 1  # it streamed, not in one piece at the end


def test_a_streamed_call_that_fails_to_parse_stops_and_its_text_is_content(tool_model: tuple[Any, Any]) -> None:
    """The documented outcome: its header (and fragments) went out, then the family's
    parser refuses the text (here one brace too many) or reads another call than
    streamed (a second "name" wins in json.loads): no ToolCall, no more fragments,
    the text is `failed` (the engine sends it as content), and the index stays used."""
    _, tok = tool_model
    for broken in ('{"name": "search", "arguments": {"query": "x"}}}',
                   '{"name": "search", "arguments": {"query": "x"}, "name": "noop"}'):
        stream = _tools.ToolCallStream(tok, TOOLS)
        deltas = feed_pieces(stream, f"<tool_call>\n{broken}\n</tool_call>"
                             '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>', random.Random(1))
        items = items_of(deltas)
        assert [(c.index, c.name) for c in items if type(c) is _tools.ToolCall] == [(1, "noop")]
        assert [c.arguments for c in items if c.index == 0 and type(c) is _tools.ToolCallDelta][0] == ""
        assert "".join(c.arguments for c in items if c.index == 0) == '{"query": "x"}'  # what streamed, no more
        assert [f.strip() for d in deltas for f in d.failed] == [broken]
    stream = _tools.ToolCallStream(tok, TOOLS)
    deltas = feed_pieces(stream, '<tool_call>\n{"name": "search", "arguments": {"query": "x"', random.Random(2))
    assert not any(d.tool_calls for d in deltas) and deltas[-1].failed  # cut off: failed, not a call
    assert not stream.called


def test_arguments_that_are_not_an_object_come_in_one_fragment_at_the_close(tool_model: tuple[Any, Any]) -> None:
    _, tok = tool_model
    deltas = feed_pieces(_tools.ToolCallStream(tok, TOOLS),
                         '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}\n</tool_call>',
                         random.Random(3))
    items = items_of(deltas)
    assert [c.arguments for c in items] == ["", '{"query": "x"}', '{"query": "x"}']


@pytest.mark.parametrize("args", ["[1, 2]", '"rain"', "3", '"[1, 2]"'])
def test_a_call_whose_arguments_are_no_object_is_content_streamed_or_whole(tool_model: tuple[Any, Any],
                                                                          args: str) -> None:
    """Every API gives a call's input as an object: arguments of `[1, 2]` came back as
    Anthropic `input: {}` whole and `[1, 2]` streamed. Now the call is refused either way (its
    text is content) and the next call is still read; so in a family that does not stream."""
    _, tok = tool_model
    text = (f'<tool_call>\n{{"name": "search", "arguments": {args}}}\n</tool_call>'
            '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')

    class Whole:  # the same parser, from a module `_tools` does not stream
        tool_parser = staticmethod(lambda text, tools: tok.tool_parser(text, tools))

        def __getattr__(self, name: str) -> Any:
            return getattr(tok, name)

    for t in (tok, Whole()):
        deltas = feed_pieces(_tools.ToolCallStream(t, TOOLS), text, random.Random(5))
        items = items_of(deltas)
        assert [(c.name, c.arguments) for c in items if type(c) is _tools.ToolCall] == [("noop", "{}")]
        assert [f.strip() for d in deltas for f in d.failed] == [f'{{"name": "search", "arguments": {args}}}']


def test_a_family_that_does_not_stream_reports_its_calls_whole(tool_model: tuple[Any, Any]) -> None:
    """qwen3_coder's XML-ish parameters have no JSON text to stream: no deltas, the call
    comes whole once closed (as before streaming existed)."""
    _, tok = tool_model

    class Coder:
        tool_parser = staticmethod(qwen3_coder.parse_tool_call)

        def __getattr__(self, name: str) -> Any:
            return getattr(tok, name)

    text = "<tool_call>\n<function=search>\n<parameter=query>\nrain\n</parameter>\n</function>\n</tool_call>"
    deltas = feed_pieces(_tools.ToolCallStream(Coder(), TOOLS), text, random.Random(4))
    items = items_of(deltas)
    assert [type(c) for c in items] == [_tools.ToolCall]
    assert (items[0].name, json.loads(items[0].arguments)) == ("search", {"query": "rain"})


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=st.sampled_from('ab{}[]":,\\/ \n\u00e9\U0001f600')),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=st.dictionaries(st.text(max_size=5), _JSON, max_size=4), name_first=st.booleans(),
       spaced=st.booleans(), ascii_only=st.booleans(), seed=st.integers(0, 2**16))
def test_any_json_call_streams_fragments_that_join_into_its_arguments(
    tool_model: tuple[Any, Any], args: dict[str, Any], name_first: bool, spaced: bool, ascii_only: bool, seed: int,
) -> None:
    """Whatever the arguments hold (braces, quotes and backslashes in strings, nesting,
    any spacing, either key order) and however the text is split: one header, then
    fragments that join into the call's arguments exactly, which read back as the
    value the model wrote."""
    _, tok = tool_model
    seps = (", ", ": ") if spaced else (",", ":")
    body = json.dumps(args, separators=seps, ensure_ascii=ascii_only)
    pairs = [f'"name"{seps[1]}"search"', f'"arguments"{seps[1]}{body}']
    text = "<tool_call>\n{" + seps[0].join(pairs if name_first else pairs[::-1]) + "}\n</tool_call>"
    items = items_of(feed_pieces(_tools.ToolCallStream(tok, TOOLS), text, random.Random(seed), most=6))
    *deltas, call = items
    assert type(call) is _tools.ToolCall and call.name == "search"
    assert all(type(d) is _tools.ToolCallDelta and d.id == call.id for d in deltas)
    assert deltas[0].arguments == "" and all(d.arguments for d in deltas[1:])
    assert "".join(d.arguments for d in deltas) == call.arguments == body
    assert json.loads(call.arguments) == args


def test_a_piece_that_closes_a_call_and_goes_on_keeps_the_texts_order(tool_model: tuple[Any, Any]) -> None:
    """Under load several tokens come as one piece: the end of a call, text, the start of
    the next. The delta keeps that order (the encoders open and close blocks by it)."""
    _, tok = tool_model
    stream = _tools.ToolCallStream(tok, TOOLS)
    first = stream.feed('<tool_call>\n{"name": "noop", "arguments": {"a"')
    piece = stream.feed(': 1}}\n</tool_call> Done. <tool_call>\n{"name": "search", "arguments": {')
    kinds = [(type(i).__name__, None if type(i) is str else i.index) for i in piece.items]
    assert kinds == [("ToolCallDelta", 0), ("ToolCall", 0), ("str", None), ("ToolCallDelta", 1), ("ToolCallDelta", 1)]
    assert piece.items[2] == " Done." and piece.tool_calls[0].arguments == '{"a": 1}'
    assert [c.arguments for c in first.calls + piece.calls[:1]] == ["", '{"a"', ": 1}"]
