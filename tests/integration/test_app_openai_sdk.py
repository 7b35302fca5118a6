"""The official openai SDK against the server: sync and async clients, streamed and not.

The SDK's clients are blocking (sync) or asyncio-based (async); both run in a
worker thread so the server keeps running on this test's trio loop.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
import trio
from app_server import HELLO, serve


def sync_calls(base_url: str) -> dict:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="k", max_retries=0, timeout=20)
    out: dict = {}
    out["models"] = [m.id for m in client.models.list()]
    chat = client.chat.completions.create(model="model", messages=HELLO, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
    out["chat"] = chat.choices[0].message.content
    out["chat_usage"] = chat.usage.completion_tokens
    pieces, finish, usage = [], None, None
    for chunk in client.chat.completions.create(model="model", messages=HELLO, max_tokens=6, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}):
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    out["chat_stream"], out["chat_stream_finish"], out["chat_stream_usage"] = "".join(pieces), finish, usage
    comp = client.completions.create(model="model", prompt="Hello", max_tokens=5, temperature=0, n=2, seed=3,
                                     extra_body={"ignore_eos": True})
    out["completion"] = [c.text for c in comp.choices]
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(model="model", prompt="Hello", max_tokens=5, temperature=0, n=2,
                                           seed=3, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] += c.text
    out["completion_stream"] = [streamed[0], streamed[1]]
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    out["not_found_code"] = info.value.code
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="model", messages=HELLO, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    out["bad_param"] = info.value.param
    return out


async def async_calls(base_url: str) -> dict:
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="k", max_retries=0, timeout=20) as client:
        chat = await client.chat.completions.create(model="model", messages=HELLO, max_tokens=6, temperature=0,
                                                    extra_body={"ignore_eos": True})
        pieces = []
        stream = await client.chat.completions.create(model="model", messages=HELLO, max_tokens=6, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            pieces += [c.delta.content or "" for c in chunk.choices]
        many = await asyncio.gather(*[
            client.completions.create(model="model", prompt=f"p{i}", max_tokens=4, extra_body={"ignore_eos": True})
            for i in range(8)
        ])
        return {"chat": chat.choices[0].message.content, "chat_stream": "".join(pieces),
                "many": [m.usage.completion_tokens for m in many]}


async def test_openai_sdk_sync(tiny_model_fp32):
    async with serve(tiny_model_fp32) as server:
        out = await trio.to_thread.run_sync(sync_calls, server.url)
    assert out["models"] == ["model"]
    assert out["chat_usage"] == 6 and out["chat_stream"] == out["chat"]
    assert out["chat_stream_finish"] == "length" and out["chat_stream_usage"] == 6
    assert out["completion_stream"] == out["completion"]
    assert out["not_found_code"] == "model_not_found" and out["bad_param"] == "tools"


async def test_openai_sdk_async(tiny_model_fp32):
    async with serve(tiny_model_fp32) as server:
        url = server.url
        out = await trio.to_thread.run_sync(lambda: asyncio.run(async_calls(url)))
    assert out["chat_stream"] == out["chat"]
    assert out["many"] == [4] * 8
