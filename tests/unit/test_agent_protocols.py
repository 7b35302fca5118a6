"""What coding agents send and expect, request by request, over the fake actor: system turns inside
Anthropic's messages, the billing header line, overflows in Anthropic's wording, cache counts in
usage, `x-should-retry` on refusals, images and documents, Codex's namespaced, custom and hosted
tools, the default length, and a log line per refusal. (tests/system/test_agents_cli.py runs the agents
themselves; the usage counts of a real prompt cache are in
tests/integration/test_agent_protocols.py.)"""

from __future__ import annotations

import json
import logging
import re
from functools import partial
from typing import Any

import pytest
from app_server import engine_factory, serve

from trio_mlx import Engine, open_engine
from trio_mlx.actor import FakeActor
from trio_mlx.engine import DEFAULT_MAX_TOKENS
from trio_mlx.models import load_tokenizer
from trio_mlx.server._settings import Settings

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
RESPONSES = "/v1/responses"
CHAT = "/v1/chat/completions"
USER = {"role": "user", "content": "Hello there"}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}


def fake(**kw: Any) -> Any:
    return engine_factory(actor=partial(FakeActor, **kw))


def replying(model: Any, text: str) -> Any:
    """A fake actor that answers `text`, then its end-of-sequence token."""
    tok = load_tokenizer(model)
    ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    return fake(reply=lambda prompt: ids)


async def test_a_system_turn_inside_messages_is_rendered_where_it_stands(tiny_model_fp32):
    mid = {"role": "system", "content": [{"type": "text", "text": "Mind the tools list."}]}
    body = {"model": "model", "max_tokens": 3, "messages": [USER, mid]}
    async with serve(tiny_model_fp32, factory=fake()) as server, server.client() as client:
        r = await client.post(MESSAGES, json=body)
        assert r.status_code == 200, r.text
        counted = await client.post(COUNT, json={k: v for k, v in body.items() if k != "max_tokens"})
        assert counted.status_code == 200, counted.text
        prompt = server.engine.encode_prompt("chat", [USER, {"role": "system", "content": "Mind the tools list."}])
    assert r.json()["usage"]["input_tokens"] == counted.json()["input_tokens"] == len(prompt)
    text = load_tokenizer(tiny_model_fp32).decode(prompt)
    # ChatML places a system turn anywhere: after the user's, as sent.
    assert text.index("Hello there") < text.index("<|im_start|>system\nMind the tools list.")


# A template that raises on a system turn after the first, as Mistral's and Gemma's do.
STRICT = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
          "{{ raise_exception('system turns must come first') }}{% endif %}"
          "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# One that renders only a leading system message and leaves the others out, silently.
DROPPING = ("{% for m in messages %}{% if m.role != 'system' or loop.first %}"
            "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.mark.parametrize("template", [STRICT, DROPPING], ids=["raises", "drops"])
async def test_a_template_that_cannot_place_a_late_system_turn_gets_it_folded_first(tiny_model_fp32, template):
    async with open_engine(tiny_model_fp32, actor=FakeActor, warmup=False) as engine:
        engine.tokenizer._tokenizer.chat_template = template
        messages = [{"role": "system", "content": "Be brief."}, USER, {"role": "system", "content": "Use tools."}]
        text = engine.tokenizer.decode(engine.encode_prompt("chat", messages))
    assert text.startswith("<|im_start|>system\nBe brief.\n\nUse tools.<|im_end|>\n<|im_start|>user\nHello there")


async def test_claude_codes_billing_header_line_neither_reaches_the_model_nor_changes_the_prompt(tiny_model_fp32):
    def body(version: str) -> dict[str, Any]:
        return {"model": "model", "messages": [USER], "system": [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version={version}; cc_entrypoint=cli;"},
            {"type": "text", "text": "You are an agent."}]}

    async with serve(tiny_model_fp32, factory=fake()) as server, server.client() as client:
        counts = [(await client.post(COUNT, json=body(v))).json()["input_tokens"] for v in ("2.1.1.abc", "2.1.1.xyz")]
        plain = server.engine.encode_prompt("chat", [{"role": "system", "content": "You are an agent."}, USER])
    assert counts == [len(plain), len(plain)]


async def test_an_overflow_is_worded_as_anthropics_on_messages_and_count_tokens(tiny_model_fp32):
    long = {"role": "user", "content": "hello " * 3000}
    async with serve(tiny_model_fp32, factory=fake(context_length=1024)) as server, server.client() as client:
        r = await client.post(MESSAGES, json={"model": "model", "max_tokens": 10, "messages": [long]})
        # max_tokens is a ceiling: a prompt that fits leaves the rest of the context to the answer
        fits = await client.post(MESSAGES, json={"model": "model", "max_tokens": 5000, "messages": [USER]})
    assert r.status_code == 400
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 1024 maximum", r.json()["error"]["message"]), r.text
    assert fits.status_code == 200 and fits.json()["stop_reason"] == "model_context_window_exceeded"


async def test_refused_keys_and_hosts_tell_the_sdks_not_to_retry(tiny_model_fp32):
    async with serve(tiny_model_fp32, factory=fake(), api_key="sekrit") as server, server.client() as client:
        for path in (MESSAGES, RESPONSES, CHAT, "/v1/models"):
            r = await client.post(path, json={}) if path != "/v1/models" else await client.get(path)
            assert r.status_code == 401 and r.headers["x-should-retry"] == "false", (path, r.headers)
        r = await client.get("/v1/models", headers={"Host": "evil.example"})
        assert r.status_code == 403 and r.headers["x-should-retry"] == "false"
        ok = await client.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200 and "x-should-retry" not in ok.headers


async def test_images_are_refused_in_the_last_user_turn_and_noted_in_history(tiny_model_fp32):
    shot = {"role": "user", "content": [{"type": "text", "text": "What is this?"}, IMAGE]}
    answer = {"role": "assistant", "content": "I cannot see images."}
    read = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [IMAGE]}]}
    called = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]}
    doc = {"type": "document", "title": "notes.txt", "source": {"type": "text", "media_type": "text/plain",
                                                               "data": "The meeting is at noon."}}
    async with serve(tiny_model_fp32, factory=fake()) as server, server.client() as client:
        async def post(messages: list[Any]) -> Any:
            return await client.post(MESSAGES, json={"model": "model", "max_tokens": 2, "messages": messages})

        refused = await post([shot])
        later = await post([shot, answer, USER])
        tool = await post([USER, called, read])
        pdf = await post([{"role": "user", "content": [{"type": "document", "source": {
            "type": "base64", "media_type": "application/pdf", "data": "AA=="}}]}])
        text_doc = await client.post(COUNT, json={"model": "model", "messages": [
            {"role": "user", "content": [doc, {"type": "text", "text": "When?"}]}]})
        prompt = server.engine.encode_prompt("chat", [
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url"}]},
            answer, USER])
        chat_later = await client.post(CHAT, json={"max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}, answer, USER]})
        chat_now = await client.post(CHAT, json={"max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]})
        responses_later = await client.post(RESPONSES, json={"max_output_tokens": 2, "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]},
            {"role": "assistant", "content": "No."}, {"role": "user", "content": "ok"}]})
        tok = load_tokenizer(tiny_model_fp32)
    error = refused.json()["error"]
    assert refused.status_code == 400 and "reads text only" in error["message"]
    assert "messages.0.content.1" in error["message"]
    assert later.status_code == 200 and tool.status_code == 200, (later.text, tool.text)
    assert pdf.status_code == 400 and "document" in pdf.json()["error"]["message"]
    assert "[image omitted: this model reads text only]" in tok.decode(prompt)
    assert text_doc.status_code == 200 and text_doc.json()["input_tokens"] > len(
        tok.encode("The meeting is at noon. When?"))
    assert chat_later.status_code == 200 and chat_now.status_code == 400
    assert chat_now.json()["error"]["code"] == "unsupported_content"
    assert responses_later.status_code == 200, responses_later.text


CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
        {"type": "function", "name": "close_agent", "strict": False, "parameters": {
            "type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"]}}]},
    {"type": "custom", "name": "apply_patch", "description": "Edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
    {"type": "web_search", "external_web_access": False},
]


def _call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.mark.parametrize("stream", [False, True])
async def test_codex_namespaced_custom_and_hosted_tools(tool_model_fp32, caplog, stream):
    caplog.set_level(logging.INFO, logger="trio_mlx.http")
    said = _call("multi_agent_v1__close_agent", {"target": "a1"}) + _call("apply_patch", {"input": "*** Begin"})
    async with serve(tool_model_fp32, factory=replying(tool_model_fp32, said)) as server, \
            server.client() as client:
        r = await client.post(RESPONSES, json={"input": "hi", "tools": CODEX_TOOLS, "stream": stream})
        prompt = server.engine.tokenizer.decode(server.engine.encode_prompt(
            "chat", [{"role": "user", "content": "hi"}],
            {"tools": [{"type": "function", "function": {"name": "multi_agent_v1__close_agent"}}]}))
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        output = events[-1]["response"]["output"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert done == output
    else:
        output = r.json()["output"]
    close, patch = output
    assert close["type"] == "function_call" and close["name"] == "close_agent"
    assert close["namespace"] == "multi_agent_v1" and json.loads(close["arguments"]) == {"target": "a1"}
    assert patch["type"] == "custom_tool_call" and patch["name"] == "apply_patch"
    assert patch["input"] == "*** Begin" and patch["call_id"]
    assert "multi_agent_v1__close_agent" in prompt
    warned = [r.getMessage() for r in caplog.records if "hosted" in r.getMessage()]
    assert warned and "web_search" in warned[0]


async def test_codex_history_with_namespaced_and_custom_calls_renders(tool_model_fp32):
    history = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "close it"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"},
        {"type": "function_call", "call_id": "c1", "name": "close_agent", "namespace": "multi_agent_v1",
         "arguments": "{\"target\": \"a1\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "closed"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": [
            {"type": "input_text", "text": "Done!"}, {"type": "input_image", "image_url": "data:,"}]},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}},
    ]
    async with serve(tool_model_fp32, factory=fake()) as server, server.client() as client:
        r = await client.post(RESPONSES, json={"input": history, "tools": CODEX_TOOLS, "max_output_tokens": 2})
        assert r.status_code == 200, r.text
        from trio_mlx.server.responses._protocol import ResponsesRequest

        messages = ResponsesRequest.model_validate({"input": history}).chat_messages()
        text = server.engine.tokenizer.decode(server.engine.encode_prompt("chat", messages))
    assert '"name": "multi_agent_v1__close_agent"' in text and "*** Begin Patch" in text
    assert "closed" in text and "Done!" in text and "[image omitted" in text and "gAAA" not in text


async def test_a_request_without_max_tokens_gets_the_default_length(tiny_model_fp32):
    assert Settings().default_max_tokens == DEFAULT_MAX_TOKENS  # the server and the library agree
    async with serve(tiny_model_fp32, factory=engine_factory(actor=FakeActor, default_max_tokens=7)) as server, \
            server.client() as client:
        chat = (await client.post(CHAT, json={"messages": [USER]})).json()
        resp = (await client.post(RESPONSES, json={"input": "hi"})).json()
    assert chat["usage"]["completion_tokens"] == 7 and chat["choices"][0]["finish_reason"] == "length"
    assert resp["usage"]["output_tokens"] == 7 and resp["status"] == "incomplete"
    async with open_engine(tiny_model_fp32, actor=FakeActor, warmup=False, default_max_tokens=0) as engine:
        async with engine.generate([5, 6, 7]) as events:
            n = sum(len(getattr(ev, "token_ids", ()) or ()) for ev in [ev async for ev in events])
            whole = events.max_tokens
    assert whole == engine.context_length - 3 and n >= 0
    with pytest.raises(ValueError, match="default_max_tokens"):
        Engine(tiny_model_fp32, default_max_tokens=-1)


async def test_every_refusal_logs_one_line_with_its_reason_and_request_id(tiny_model_fp32, caplog):
    caplog.set_level(logging.INFO, logger="trio_mlx.http")
    async with serve(tiny_model_fp32, factory=fake()) as server, server.client() as client:
        bad = await client.post(CHAT, json={"messages": [USER], "max_tokens": 0})
        anthropic = await client.post(MESSAGES, json={"model": "model", "messages": [USER]})
        missing = await client.get("/v1/models/nope")
    for r, reason in ((bad, "max_tokens"), (anthropic, "max_tokens"), (missing, "does not exist")):
        rid = r.headers["x-request-id"]
        lines = [rec.getMessage() for rec in caplog.records if f"request {rid} refused" in rec.getMessage()]
        assert len(lines) == 1 and str(r.status_code) in lines[0] and reason in lines[0], (rid, lines)
