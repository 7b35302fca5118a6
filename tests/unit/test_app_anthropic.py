"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) against a real server,
through the official `anthropic` SDK (its clients run in a worker thread) and raw HTTP.

Here the refusals made before a request is routed, over the fake actor; the API itself, on a real
model: tests/integration/test_app_anthropic.py.
"""

from __future__ import annotations

import json

from app_server import fake_factory, open_raw, read_response, serve

MESSAGES = "/v1/messages"
USER = [{"role": "user", "content": "Hello there"}]


async def test_refusals_before_routing_have_anthropics_shape(tiny_model_fp32):
    """The host check (DNS rebinding) and the framing check run before a request is routed, and
    404s come from the router itself; on Anthropic's paths all are Anthropic errors (an SDK
    reads only those)."""
    async with serve(tiny_model_fp32, factory=fake_factory()) as server, server.client() as client:
        body = {"model": "model", "max_tokens": 4, "messages": USER}
        r = await client.post(MESSAGES, json=body, headers={"Host": "evil.example"})
        assert r.status_code == 403, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "permission_error", r.text
        raw_body = json.dumps(body).encode()
        chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(raw_body), raw_body)
        sock = await open_raw(server.port, MESSAGES, chunked,
                              headers={"Content-Length": str(len(chunked)), "Transfer-Encoding": "chunked"})
        raw = await read_response(sock)
        sock.close()
        assert raw.startswith(b"HTTP/1.1 400"), raw[:300]
        obj = json.loads(raw.split(b"\r\n\r\n", 1)[1])
        assert obj["type"] == "error" and obj["error"]["type"] == "invalid_request_error", obj
        # so are the 404s under Anthropic's paths (an endpoint this server does not have)
        r = await client.get(MESSAGES + "/batches")
        assert r.status_code == 404 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "not_found_error"
        r = await client.get(MESSAGES + "/batches", headers={"Host": "evil.example"})  # refused before routing
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
        # the OpenAI paths keep OpenAI's shape
        r = await client.get("/v1/chat/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
        r = await client.post("/v1/chat/completions", json={"messages": USER}, headers={"Host": "evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
