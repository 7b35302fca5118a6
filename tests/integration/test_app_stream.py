"""Server-sent events: raw framing, headers, chunk shapes, usage, n > 1, pings, errors mid-stream."""

from __future__ import annotations

import dataclasses
import json
import math
from functools import partial

import httpx
import httpx_sse
import trio
from app_server import (
    CHAT,
    COMPLETIONS,
    chat_body,
    engine_factory,
    serve,
    slow_steps,
    sse_events,
    until,
)


async def read_stream(client, path: str, body: dict) -> tuple[dict, bytes]:
    async with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        raw = b"".join([chunk async for chunk in resp.aiter_raw()])
        return dict(resp.headers), raw


def data_events(raw: bytes) -> list:
    out = []
    for event in sse_events(raw):
        if event.startswith(b":"):
            continue
        assert event.startswith(b"data: ") and b"\n" not in event, event
        payload = event[len(b"data: "):]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


async def test_chat_stream_framing_headers_and_chunks(tiny_model_fp32):
    records = []
    async with serve(tiny_model_fp32) as server, server.client() as client:
        server.app.observers.append(records.append)
        body = chat_body(max_tokens=10, stream=True, temperature=0, ignore_eos=True,
                         stream_options={"include_usage": True})
        headers, raw = await read_stream(client, CHAT, body)
        assert headers["content-type"] == "text/event-stream"
        assert headers["cache-control"] == "no-cache"
        assert headers["x-accel-buffering"] == "no"
        events = data_events(raw)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        *content, finish, usage = chunks
        ids = {c["id"] for c in chunks}
        assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
        assert all(c["object"] == "chat.completion.chunk" and c["model"] == "model" for c in chunks)
        # the role comes with the first content token, not before
        assert content[0]["choices"][0]["delta"]["role"] == "assistant"
        assert content[0]["choices"][0]["delta"]["content"]
        assert all("role" not in c["choices"][0]["delta"] for c in content[1:])
        assert all(c["choices"][0]["finish_reason"] is None and c["usage"] is None for c in content)
        assert finish["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
        # one event per wake-up: never more events than tokens, and the text is the non-streamed text
        assert len(content) <= 10
        text = "".join(c["choices"][0]["delta"]["content"] for c in content)
        whole = await client.post(CHAT, json={**body, "stream": False})
        assert whole.json()["choices"][0]["message"]["content"] == text
        await until(lambda: len(records) == 2)
        for rec in records:
            assert rec.outcome == "ok" and rec.status == 200 and rec.completion_tokens == 10
            assert rec.arrived <= rec.admitted <= rec.first_token <= rec.ended
        assert [r.stream for r in records] == [True, False]


async def test_keep_alive_connections_close_promptly_at_shutdown(tiny_model_fp32):
    # quart-trio used to cancel hypercorn's keep-alive recycling (see _app._HTTPConnection):
    # such a connection then held shutdown for the whole graceful timeout (5 s here).
    async with httpx.AsyncClient(timeout=10) as client:
        for kind in ("quart", "stream", "whole"):
            async with serve(tiny_model_fp32) as server:
                if kind == "quart":
                    assert (await client.get(server.url + "/v1/models")).status_code == 200
                else:
                    _, raw = await read_stream(client, server.url + CHAT, chat_body(max_tokens=2, stream=kind == "stream"))
                t0 = trio.current_time()
            assert trio.current_time() - t0 < 2.0, kind


async def test_completion_stream_and_httpx_sse(tiny_model_fp32):
    async with serve(tiny_model_fp32) as server, server.client() as client:
        body = {"prompt": "Hello", "max_tokens": 6, "stream": True, "ignore_eos": True, "temperature": 0}
        seen = []
        async with httpx_sse.aconnect_sse(client, "POST", COMPLETIONS, json=body) as source:
            async for sse in source.aiter_sse():
                seen.append(sse.data)
        assert seen[-1] == "[DONE]"
        chunks = [json.loads(d) for d in seen[:-1]]
        assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all("usage" not in c for c in chunks)  # no include_usage
        text = "".join(c["choices"][0]["text"] for c in chunks)
        whole = await client.post(COMPLETIONS, json={**body, "stream": False})
        assert whole.json()["choices"][0]["text"] == text


async def test_n_streams_interleave_with_their_index(tiny_model_fp32):
    async with serve(tiny_model_fp32) as server, server.client() as client:
        body = chat_body(max_tokens=8, n=3, seed=11, stream=True, ignore_eos=True,
                         stream_options={"include_usage": True})
        _, raw = await read_stream(client, CHAT, body)
        events = data_events(raw)
        assert events[-1] == "[DONE]"
        usage = events[-2]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 24
        texts = {0: "", 1: "", 2: ""}
        finishes = {}
        for chunk in events[:-2]:
            (choice,) = chunk["choices"]
            i = choice["index"]
            assert i not in finishes, "content after its finish"
            if choice["finish_reason"] is not None:
                finishes[i] = choice["finish_reason"]
            else:
                texts[i] += choice["delta"]["content"]
        assert finishes == {0: "length", 1: "length", 2: "length"}
        whole = (await client.post(CHAT, json={**body, "stream": False})).json()
        assert [c["message"]["content"] for c in whole["choices"]] == [texts[0], texts[1], texts[2]]


async def test_logprobs_stream(tiny_model_fp32):
    async with serve(tiny_model_fp32) as server, server.client() as client:
        _, raw = await read_stream(client, CHAT, chat_body(max_tokens=5, stream=True, logprobs=True, top_logprobs=2,
                                                           ignore_eos=True))
        content = [e for e in data_events(raw)[:-1] if e["choices"][0]["finish_reason"] is None]
        entries = [x for c in content for x in c["choices"][0]["logprobs"]["content"]]
        assert len(entries) == 5 and all(len(x["top_logprobs"]) == 2 for x in entries)
        _, raw = await read_stream(client, COMPLETIONS, {"prompt": "a", "max_tokens": 5, "stream": True,
                                                         "logprobs": 1, "ignore_eos": True})
        content = [e for e in data_events(raw)[:-1] if e["choices"][0]["finish_reason"] is None]
        offsets = [o for c in content for o in c["choices"][0]["logprobs"]["text_offset"]]
        assert len(offsets) == 5 and offsets[0] == 0 and offsets == sorted(offsets)


async def test_pings_while_queued(tiny_model_fp32):
    factory = engine_factory(fault_hook=slow_steps(0.01))
    async with serve(tiny_model_fp32, max_batch=1, prefill_batch=1, ping_interval=0.05,
                     factory=factory) as server, server.client() as client, trio.open_nursery() as nursery:
        nursery.start_soon(partial(client.post, COMPLETIONS, json={"prompt": "busy", "max_tokens": 60,
                                                                   "ignore_eos": True}))
        await until(lambda: server.engine.statistics().decoding == 1)
        _, raw = await read_stream(client, CHAT, chat_body(max_tokens=3, stream=True))
        events = sse_events(raw)
        first_data = next(i for i, e in enumerate(events) if e.startswith(b"data: "))
        assert first_data >= 2 and all(e == b": ping" for e in events[:first_data]), events[:first_data + 1]
        assert not any(e == b": ping" for e in events[first_data:])


async def test_failure_after_the_stream_started_is_one_error_event_then_done(tiny_model_fp32):
    mode = {"fail": False}

    def hook(stage: str) -> None:
        if stage == "step" and mode["fail"]:
            raise RuntimeError("injected")

    async with serve(tiny_model_fp32, factory=engine_factory(fault_hook=hook)) as server, server.client() as client:
        async with client.stream("POST", CHAT, json=chat_body(max_tokens=500, stream=True, ignore_eos=True)) as resp:
            raw = b""
            async for chunk in resp.aiter_raw():
                raw += chunk
                if b"data: " in raw:
                    mode["fail"] = True
        events = data_events(raw)
        assert events[-1] == "[DONE]"
        assert set(events[-2]) == {"error"}
        assert events[-2]["error"]["code"] == "generation_failed" and "injected" not in raw.decode("utf-8", "replace")
        assert all("choices" in e for e in events[:-2])


async def test_drain_ends_open_streams_with_a_terminal_event(tiny_model_fp32):
    factory = engine_factory(fault_hook=slow_steps(0.005))
    async with serve(tiny_model_fp32, factory=factory, drain_timeout=0.3) as server, server.client() as client:
        async with client.stream("POST", CHAT, json=chat_body(max_tokens=900, stream=True, ignore_eos=True)) as resp:
            raw = b""
            async with trio.open_nursery() as nursery:
                async for chunk in resp.aiter_raw():
                    raw += chunk
                    if b"data: " in raw and server.engine.state == "ready":
                        nursery.start_soon(server.app.drain)
        events = data_events(raw)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "aborted"


async def test_stream_interval_sends_fewer_bigger_events(tiny_model_fp32):
    factory = engine_factory(fault_hook=slow_steps(0.005))
    async with serve(tiny_model_fp32, stream_interval=0.1, factory=factory) as server, server.client() as client:
        body = chat_body(max_tokens=60, stream=True, ignore_eos=True, temperature=0)
        t0 = trio.current_time()
        _, raw = await read_stream(client, CHAT, body)
        elapsed = trio.current_time() - t0
        content = [e for e in data_events(raw)[:-1] if e["choices"][0]["finish_reason"] is None]
        # one event per 0.1 s of generation (~0.35 s here; longer on a loaded machine), the first
        # at once: far fewer than the 60 tokens' one each
        assert 1 < len(content) <= min(20, math.ceil(elapsed / 0.1) + 2), (len(content), elapsed)
        whole = await client.post(CHAT, json={**body, "stream": False})
        assert "".join(c["choices"][0]["delta"]["content"] for c in content) == \
            whole.json()["choices"][0]["message"]["content"]


async def test_pacing_never_holds_back_the_end_of_a_stream(tiny_model_fp32):
    # A 3 s gap between events, and ~0.2 s of generation: the first tokens go out
    # at once, the rest (and the end) as soon as the engine finishes, not after the gap.
    factory = engine_factory(fault_hook=slow_steps(0.005))
    async with serve(tiny_model_fp32, stream_interval=3.0, factory=factory) as server, server.client() as client:
        for n in (1, 2):
            body = chat_body(max_tokens=30, stream=True, ignore_eos=True, temperature=0, n=n)
            t0 = trio.current_time()
            _, raw = await read_stream(client, CHAT, body)
            elapsed = trio.current_time() - t0
            events = data_events(raw)
            assert events[-1] == "[DONE]"
            assert elapsed < 2.5, (n, elapsed)  # held back, it would take >= 3 s
            if n == 1:  # still coalesced: the first tokens, then the rest (n > 1 sends a chunk per delta)
                sends = [e for e in events[:-1] if e["choices"][0]["finish_reason"] is None]
                assert len(sends) <= 2, events
            whole = await client.post(CHAT, json={**body, "stream": False})
            for i, choice in enumerate(whole.json()["choices"]):
                streamed = "".join(c["delta"].get("content") or "" for e in events[:-1]
                                   for c in e["choices"] if c["index"] == i)
                assert streamed == choice["message"]["content"]


async def test_pacing_coalesces_tokens_as_streams_multiply(tiny_model_fp32):
    # 4 open streams at 20 events/s in all: each stream waits 0.2 s between events.
    factory = engine_factory(fault_hook=slow_steps(0.005))
    async with serve(tiny_model_fp32, max_event_rate=20.0, factory=factory) as server, server.client() as client:
        body = chat_body(max_tokens=60, stream=True, ignore_eos=True, temperature=0)
        counts: list[tuple[int, int]] = []

        async def one() -> None:
            _, raw = await read_stream(client, CHAT, body)
            content = [e for e in data_events(raw)[:-1] if e["choices"][0]["finish_reason"] is None]
            tokens = server.engine.encode_prompt("text", "".join(c["choices"][0]["delta"]["content"] for c in content))
            counts.append((len(content), len(tokens)))

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(one)
        for events, _ in counts:
            assert 1 < events <= 6, counts  # ~0.35 s of tokens at one event per 0.2 s
        # with pacing off, the same load streams (nearly) one event per step
        server.app.settings = dataclasses.replace(server.app.settings, max_event_rate=0.0)
        _, raw = await read_stream(client, CHAT, body)
        assert len(data_events(raw)) > 20
