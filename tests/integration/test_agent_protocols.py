"""What coding agents expect of usage with a real prompt cache (the tiny model in process); the
rest of what they send and expect runs over the fake actor in tests/unit/test_agent_protocols.py."""

from __future__ import annotations

import json

from app_server import serve

MESSAGES = "/v1/messages"
USER = {"role": "user", "content": "Hello there"}


async def test_usage_counts_prompt_cache_reads_as_anthropic_does(tiny_model_fp32):
    """Cached tokens are `cache_read_input_tokens`, the rest `input_tokens` (their sum is the prompt)."""
    body = {"model": "model", "max_tokens": 4, "temperature": 0, "system": "You are terse. " * 20,
            "messages": [USER]}
    async with serve(tiny_model_fp32) as server, server.client() as client:
        first = (await client.post(MESSAGES, json=body)).json()["usage"]
        second = (await client.post(MESSAGES, json=body)).json()["usage"]
        streamed = (await client.post(MESSAGES, json={**body, "stream": True})).text
    assert first["cache_read_input_tokens"] == 0 and first["cache_creation_input_tokens"] == 0
    assert second["cache_read_input_tokens"] > 0
    assert second["input_tokens"] + second["cache_read_input_tokens"] == first["input_tokens"]
    events = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: ")]
    delta = events[-2]
    assert delta["type"] == "message_delta" and delta["usage"]["cache_read_input_tokens"] > 0
    # message_start says what message_delta ends with (it said 0 cached, the whole prompt as input)
    start = events[0]
    assert start["type"] == "message_start", start
    usage = start["message"]["usage"]
    assert usage["cache_read_input_tokens"] == delta["usage"]["cache_read_input_tokens"], (usage, delta)
    assert usage["input_tokens"] == delta["usage"]["input_tokens"] == second["input_tokens"], (usage, delta)
