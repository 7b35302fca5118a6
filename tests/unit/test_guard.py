"""A local server is safe from web pages (server/_guard.py), against a real hypercorn on 127.0.0.1
over the fake actor (what it refuses does not depend on a model).

DNS rebinding: a page whose name resolves to 127.0.0.1 sends its own name as Host; such a
request gets 403 on every path. A cross-origin "simple" POST (text/plain, a Blob without a
type) skips the CORS preflight; a body without `Content-Type: application/json` gets 415.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from app_server import CHAT, COMPLETIONS, HELLO, assert_error, fake_factory, serve

from trio_mlx.server._guard import check_host
from trio_mlx.server._http import HTTPError

pytestmark = pytest.mark.timeout(60)

BODY = {"messages": HELLO, "max_tokens": 2}


async def test_a_foreign_host_name_over_loopback_is_refused_everywhere(tiny_model_fp32: Path) -> None:
    async with serve(tiny_model_fp32, factory=fake_factory()) as server, server.client() as client:
        port = server.port
        for host in (f"attacker.example:{port}", "attacker.example", "192.168.1.5", "x", "localhost.evil.com"):
            h = {"Host": host}
            err = assert_error(await client.post(CHAT, json=BODY, headers=h), 403, code="host_not_allowed")
            assert "--allowed-hosts" in err["message"]
            assert_error(await client.post(COMPLETIONS, json={"prompt": "a"}, headers=h), 403)
            for path in ("/health", "/ready", "/v1/models", "/metrics", "/"):
                assert_error(await client.get(path, headers=h), 403, code="host_not_allowed")
            assert_error(await client.options(CHAT, headers={**h, "Origin": "http://attacker.example",
                                                              "Access-Control-Request-Method": "POST"}), 403)
        for host in (f"127.0.0.1:{port}", "127.0.0.1", "127.1.2.3:9", f"localhost:{port}", "LOCALHOST",
                     "app.localhost", f"[::1]:{port}", "[::1]"):
            r = await client.post(CHAT, json=BODY, headers={"Host": host})
            assert r.status_code == 200, (host, r.text)
            assert (await client.get("/health", headers={"Host": host})).status_code == 200


async def test_allowed_hosts_add_names(tiny_model_fp32: Path) -> None:
    async with serve(tiny_model_fp32, factory=fake_factory(), allowed_hosts=("api.example", ".corp.test")) as server, \
            server.client() as client:
        for host in ("api.example", "API.example:443", "corp.test", "llm.corp.test:8000"):
            assert (await client.post(CHAT, json=BODY, headers={"Host": host})).status_code == 200, host
        for host in ("evil.example", "api.example.evil", "xcorp.test"):
            assert_error(await client.post(CHAT, json=BODY, headers={"Host": host}), 403)
    async with serve(tiny_model_fp32, factory=fake_factory(), allowed_hosts=("*",)) as server, server.client() as client:
        assert (await client.get("/health", headers={"Host": "anything.example"})).status_code == 200


def test_connections_that_did_not_come_over_loopback_are_not_restricted() -> None:
    scope = {"server": ("10.1.2.3", 8000), "headers": [(b"host", b"llm.example.com")]}
    check_host(scope, ())
    with pytest.raises(HTTPError):
        check_host({**scope, "server": ("127.0.0.1", 8000)}, ())
    check_host({"server": ("::1", 8000), "headers": [(b"host", b"[::1]:8000")]}, ())
    check_host({"server": None, "headers": [(b"host", b"evil")]}, ())  # a unix socket: no address


async def test_a_body_must_say_it_is_json(tiny_model_fp32: Path) -> None:
    async with serve(tiny_model_fp32, factory=fake_factory()) as server, server.client() as client:
        import json

        raw = json.dumps(BODY).encode()
        for headers in ({}, {"content-type": "text/plain"}, {"content-type": "text/plain;charset=UTF-8"},
                        {"content-type": "application/x-www-form-urlencoded"},
                        {"content-type": "multipart/form-data; boundary=x"}, {"content-type": "application/jsonx"}):
            for path in (CHAT, COMPLETIONS):
                r = await client.post(path, content=raw, headers=headers)
                err = assert_error(r, 415, code="unsupported_media_type")
                assert "application/json" in err["message"]
                # the body was not read: the connection cannot carry another request, and says so
                assert r.headers.get("connection") == "close", r.headers
            for path in ("/v1/messages", "/v1/responses"):  # the other APIs refuse it alike
                r = await client.post(path, content=raw, headers=headers)
                assert r.status_code == 415 and "application/json" in r.text, (path, r.text)
                assert r.headers.get("connection") == "close", (path, r.headers)
        stats = server.engine.statistics()
        assert stats.requests_submitted == 0  # none of them reached the engine
        for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
            r = await client.post(CHAT, content=raw, headers={"content-type": ctype})
            assert r.status_code == 200, (ctype, r.text)
