"""The HTTP API's successful paths: probes, models, OpenAPI, chat and text completions (not streamed).

Here the paths whose answers do not depend on the model (probes, models, OpenAPI, the accepted
forms of options), over the fake actor; the completions themselves: tests/integration/test_app_api.py.
"""

from __future__ import annotations

import os

from app_server import CHAT, fake_factory, serve


async def test_probes_models_and_openapi(tiny_model_fp32):
    async with serve(tiny_model_fp32, factory=fake_factory(), model_name="tiny-test") as server, server.client() as client:
        r = await client.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert r.json()["actor"] == "thread" and r.json()["actor_pid"] == os.getpid()
        for path in ("/ready", "/health/ready"):
            r = await client.get(path)
            assert r.status_code == 200 and r.json() == {"status": "ready"}
        r = await client.get("/v1/models")
        assert r.status_code == 200
        body = r.json()
        assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["tiny-test"]
        assert body["data"][0]["context_length"] == server.engine.context_length
        r = await client.get("/v1/models/tiny-test")
        assert r.status_code == 200 and r.json()["id"] == "tiny-test"
        doc = (await client.get("/openapi.json")).json()
        assert doc["openapi"].startswith("3.")
        assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready"} <= set(doc["paths"])
        schemas = doc["components"]["schemas"]
        assert "messages" in schemas["ChatCompletionRequest"]["properties"]
        assert "prompt" in schemas["CompletionRequest"]["properties"]
        # every $ref resolves
        text = r.text + str(doc)
        for name in {part.split("'")[0] for part in text.split("#/components/schemas/")[1:]}:
            assert name in schemas, name


async def test_chat_accepts_text_parts_developer_role_and_the_noop_forms_of_options(tiny_model_fp32):
    async with serve(tiny_model_fp32, factory=fake_factory()) as server, server.client() as client:
        parts = [{"role": "developer", "content": "Be brief."},
                 {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
        r = await client.post(CHAT, json={
            "messages": parts, "max_tokens": 3, "response_format": {"type": "text"}, "tool_choice": "none",
            "user": "u-1", "stream_options": None, "parallel_tool_calls": False, "metadata": {"x": "y"},
        })
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 3


async def test_the_openapi_document_is_built_once_off_the_event_loop(tiny_model_fp32, monkeypatch):
    """Its first build (the module's import and pydantic's schemas, ~70 ms on the CPU dev box)
    ran on the event loop every stream shares, for any client that asked."""
    import threading

    from trio_mlx.server import _openapi

    built_in = []
    real = _openapi.openapi_document

    def recording(settings, routes):
        built_in.append(threading.current_thread())
        return real(settings, routes)

    monkeypatch.setattr(_openapi, "openapi_document", recording)
    async with serve(tiny_model_fp32, factory=fake_factory()) as server, server.client() as client:
        docs = [(await client.get("/openapi.json")).json() for _ in range(3)]
    assert docs[0] == docs[1] == docs[2] and "/v1/chat/completions" in docs[0]["paths"]
    assert len(built_in) == 1 and built_in[0] is not threading.current_thread()
