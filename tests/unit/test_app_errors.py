"""Every error status the HTTP API sends, each in OpenAI's shape {"error": {message, type, param, code}}.

Here the errors the HTTP layer answers by itself, over the fake actor; those that come from the
engine's state (a full queue, a drain, a failed or stalled step): tests/integration/test_app_errors.py.
"""

from __future__ import annotations

import logging

import trio
from app_server import (
    CHAT,
    COMPLETIONS,
    HELLO,
    assert_error,
    chat_body,
    fake_factory,
    serve,
)

from trio_mlx import Engine
from trio_mlx.actor import FakeActor


async def test_400_bad_bodies(tiny_model_fp32):
    async with serve(tiny_model_fp32, factory=fake_factory()) as server, server.client() as client:
        json_ct = {"content-type": "application/json"}
        assert_error(await client.post(CHAT, content=b'{"messages": [', headers=json_ct), 400, code="invalid_json")
        assert_error(await client.post(CHAT, content=b'{"x": "\xff\xfe"}', headers=json_ct), 400, code="invalid_json")
        assert_error(await client.post(CHAT, content=b"[1, 2]", headers=json_ct), 400, code="invalid_json")
        assert_error(await client.post(CHAT, content=b"", headers=json_ct), 400, code="invalid_json")
        deep = b"[" * 100_000 + b"]" * 100_000
        assert_error(await client.post(CHAT, content=deep, headers=json_ct), 400, code="invalid_json")
        assert_error(await client.post(CHAT, content=b"messages=hi",
                                       headers={"content-type": "application/x-www-form-urlencoded"}),
                     415, code="unsupported_media_type")


async def test_400_schema_violations_name_their_parameter(tiny_model_fp32):
    async with serve(tiny_model_fp32, factory=fake_factory()) as server, server.client() as client:
        cases = [
            ({"messages": []}, "messages"),
            ({"messages": "hi"}, "messages"),
            ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
            ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]},
             "messages.0.content.0.type"),
            # an image the text-only model cannot read, in the user's last turn (in history: a note)
            ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
             "messages[0].content[0]"),
            (chat_body(max_tokens=0), "max_tokens"),
            (chat_body(max_tokens="12"), "max_tokens"),
            (chat_body(temperature=-1), "temperature"),
            (chat_body(top_p=0), "top_p"),
            (chat_body(n=0), "n"),
            (chat_body(n=17), "n"),
            (chat_body(stop=[1]), "stop.0"),
            (chat_body(top_logprobs=21, logprobs=True), "top_logprobs"),
            (chat_body(top_logprobs=2), "top_logprobs"),
            (chat_body(logit_bias={"not-a-token": 1}), "logit_bias"),
            (chat_body(logit_bias={"1": 1000}), "logit_bias"),
            (chat_body(stream="yes"), "stream"),
        ]
        for body, param in cases:
            err = assert_error(await client.post(CHAT, json=body), 400, param=param)
            assert err["type"] == "invalid_request_error"
        for body, param in [({"prompt": []}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
                            ({"prompt": [1, "a"]}, "prompt"), ({"prompt": [-5]}, "prompt"),
                            ({}, "prompt")]:
            assert_error(await client.post(COMPLETIONS, json=body), 400, param=param)


async def test_400_unsupported_options_are_refused_not_ignored(tiny_model_fp32):
    async with serve(tiny_model_fp32, factory=fake_factory()) as server, server.client() as client:
        # (tools and response_format are served: tests/integration/test_app_tools.py)
        for extra, param in [
            ({"functions": [{"name": "f"}]}, "functions"),
            ({"function_call": "auto"}, "function_call"),
            ({"modalities": ["text", "audio"]}, "modalities"),
        ]:
            assert_error(await client.post(CHAT, json=chat_body(**extra)), 400, param=param,
                         code="unsupported_parameter")
        for extra, param in [({"echo": True}, "echo"), ({"suffix": "end"}, "suffix"), ({"best_of": 3}, "best_of")]:
            assert_error(await client.post(COMPLETIONS, json={"prompt": "a", **extra}), 400, param=param,
                         code="unsupported_parameter")


async def test_400_context_length_exceeded(tiny_model_fp32):
    async with serve(tiny_model_fp32, factory=fake_factory()) as server, server.client() as client:
        n = server.engine.context_length
        assert_error(await client.post(CHAT, json=chat_body(max_tokens=n)), 400,
                     code="context_length_exceeded", param="messages")
        assert_error(await client.post(COMPLETIONS, json={"prompt": [5] * (n + 1), "max_tokens": 1}), 400,
                     code="context_length_exceeded", param="prompt")


async def test_astral_text_is_refused_by_its_bytes_before_tokenizing(tiny_model_fp32):
    # 650,000 astral characters (2.6 MB) passed a bound that counted characters against the
    # longest token (81 characters for the embedded default): 7.2 s and 610 MB before the 400.
    # Here 10,000 of them: 770 tokens by characters (13 a token, the tiny model's longest
    # entry), 3,077 by bytes, in a context of 1,024.
    encoded: list[int] = []

    class Counting(Engine):
        def encode_prompt(self, kind, value, template_kwargs=None):
            encoded.append(1)
            return super().encode_prompt(kind, value, template_kwargs)

    def make(settings):
        return Counting(settings.model, actor=FakeActor, warmup=False)

    async with serve(tiny_model_fp32, factory=make) as server, server.client() as client:
        astral = "\U0001F600" * 10_000
        r = await client.post(COMPLETIONS, json={"prompt": astral, "max_tokens": 4})
        err = assert_error(r, 400, code="context_length_exceeded", param="prompt")
        assert "40000 bytes of text, at least 3077 tokens" in err["message"], err
        r = await client.post(CHAT, json={"messages": [{"role": "user", "content": astral}], "max_tokens": 4})
        assert_error(r, 400, code="context_length_exceeded", param="messages")
        assert encoded == []  # neither reached the tokenizer
        r = await client.post(COMPLETIONS, json={"prompt": "\U0001F600" * 50, "max_tokens": 4})
        assert r.status_code == 200, r.text  # a short one is served
        assert encoded == [1]


async def test_401_with_an_api_key(tiny_model_fp32):
    async with serve(tiny_model_fp32, factory=fake_factory(), api_key="s3cret") as server, server.client() as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = await client.post(CHAT, json=chat_body(), headers=headers)
            assert_error(r, 401, code="invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
            assert_error(await client.get("/v1/models", headers=headers), 401, code="invalid_api_key")
        ok = {"Authorization": "Bearer s3cret"}
        assert (await client.post(CHAT, json=chat_body(max_tokens=2), headers=ok)).status_code == 200
        assert (await client.get("/v1/models", headers=ok)).status_code == 200
        # probes stay open for orchestrators
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/ready")).status_code == 200
        doc = (await client.get("/openapi.json")).json()
        assert doc["paths"]["/v1/chat/completions"]["post"]["security"] == [{"bearer": []}]


async def test_404_405_413(tiny_model_fp32):
    async with serve(tiny_model_fp32, factory=fake_factory(), max_body_bytes=4096) as server, server.client() as client:
        assert_error(await client.post(CHAT, json=chat_body(model="gpt-4")), 404, code="model_not_found",
                     param="model")
        assert_error(await client.post(COMPLETIONS, json={"prompt": "a", "model": "x"}), 404, code="model_not_found")
        assert_error(await client.get("/v1/models/gpt-4"), 404, code="model_not_found")
        assert_error(await client.get("/v1/nothing"), 404, code="not_found")
        assert_error(await client.post("/v1/embeddings", json={}), 404, code="not_found")
        r = await client.get(CHAT)
        assert_error(r, 405, code="method_not_allowed")
        assert "POST" in r.headers["allow"]
        r = await client.post("/v1/models", json={})
        assert_error(r, 405, code="method_not_allowed")
        assert "GET" in r.headers["allow"]
        big = {"messages": [{"role": "user", "content": "x" * 5000}]}
        assert_error(await client.post(CHAT, json=big), 413, code="request_too_large")
        # the server still answers on a fresh connection
        assert (await client.get("/health")).status_code == 200


async def test_500_never_leaks_internals(tiny_model_fp32, caplog):
    class Faulty(Engine):
        def chat(self, *args, **kwargs):
            raise RuntimeError("secret internal detail")

    def factory(settings):
        return Faulty(settings.model, warmup=False, actor=FakeActor)

    async with serve(tiny_model_fp32, factory=factory) as server, server.client() as client:
        with caplog.at_level(logging.ERROR, logger="trio_mlx.http"):
            r = await client.post(CHAT, json=chat_body())
        err = assert_error(r, 500, code="internal_error", type="server_error")
        assert "secret" not in r.text and err["message"] == "internal server error"
        assert any("secret internal detail" in (rec.exc_text or "") for rec in caplog.records)
        # the server keeps serving
        assert (await client.post(COMPLETIONS, json={"prompt": "a", "max_tokens": 2})).status_code == 200


async def test_idle_server_is_healthy_and_cors(tiny_model_fp32):
    async with serve(tiny_model_fp32, factory=fake_factory(), cors_origins=("https://app.example",), watchdog_seconds=0.1) as server, \
            server.client() as client:
        await trio.sleep(0.3)  # idle for longer than the watchdog: still healthy
        assert (await client.get("/health")).status_code == 200
        origin = {"Origin": "https://app.example"}
        r = await client.post(CHAT, json=chat_body(max_tokens=2), headers=origin)
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        r = await client.get("/v1/models", headers=origin)
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        pre = {**origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        r = await client.options(CHAT, headers=pre)
        assert r.status_code == 204 and "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"]
        # the SDKs' own headers pass the preflight (a fixed list refused openai-node's x-stainless-*
        # and the anthropic SDK's browser header), on every API; only header names are echoed
        asked = "content-type, x-stainless-os, x-stainless-timeout, anthropic-dangerous-direct-browser-access, a b"
        for path in (CHAT, "/v1/messages", "/v1/models"):
            r = await client.options(path, headers={**pre, "Access-Control-Request-Headers": asked})
            allowed = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
            assert {"x-stainless-os", "x-stainless-timeout", "anthropic-dangerous-direct-browser-access"} <= allowed
            assert "a b" not in allowed and "access-control-expose-headers" not in r.headers
        # and a page's script may read the retry advice and the request id
        r = await client.post(CHAT, json=chat_body(max_tokens=2), headers=origin)
        assert {"retry-after", "x-should-retry", "x-request-id"} <= {
            h.strip() for h in r.headers["access-control-expose-headers"].split(",")}
        r = await client.post(CHAT, json=chat_body(max_tokens=2), headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers
        assert_error(await client.post(CHAT, json={"messages": HELLO, "model": "nope"}, headers=origin), 404)


async def test_n_past_the_batch_and_queue_is_a_400_not_a_429_forever(tiny_model_fp32):
    """A request's n choices are submitted one by one: past --max-batch plus --max-queue they can
    never all be taken, and an idle server answered 429 queue_full (retryable) every time."""
    async with serve(tiny_model_fp32, factory=fake_factory(), max_batch=2, max_queue=2) as server, \
            server.client() as client:
        err = assert_error(await client.post(CHAT, json=chat_body(max_tokens=2, n=5)), 400, param="n")
        assert "at most 4" in err["message"] and "--max-queue" in err["message"], err
        r = await client.post(CHAT, json=chat_body(max_tokens=2, n=4))
        assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text
