"""Bad input, generated and by hand, against a server process: never a 5xx, never a hang, always
OpenAI's error shape.

- schemathesis generates requests (valid and invalid) from the server's own /openapi.json;
- hypothesis fuzzes the request models in-process (any JSON in: a 400 naming its parameter, or
  options the engine's own checks accept or refuse with InvalidRequestError) and over HTTP;
- explicit cases: huge bodies, invalid UTF-8, wrong content types, deep nesting, absurd numbers.

The server serves a copy of the tiny model with a 48-token context, and answers a request that
names no max_tokens with 4 tokens, so that whatever the fuzzers ask for stays cheap to generate. Its log must hold no ERROR and no traceback at the end.

Here against a server process; the request models in process: tests/unit/test_fuzz.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from processes import ENV, SERVE
from schemathesis.specs.openapi.checks import positive_data_acceptance
from unit.test_fuzz import json_values, request_objects

from trio_mlx.server._openapi import openapi_document
from trio_mlx.server._routes import ROUTES
from trio_mlx.server._settings import Settings

CONTEXT = 48
MAX_N = 2
# What an answer gets when its request names no max_tokens (most generated cases): the fuzzers
# check status codes and shapes, and a request's whole context in tokens cost the server most of its CPU.
DEFAULT_MAX_TOKENS = 4
# Examples per fuzz test: CI keeps it at 100 (a third of that per operation of the OpenAPI document,
# whose cases run through a server: about 20 s for the module); set the variable for a long run.
EXAMPLES = int(os.environ.get("TRIO_MLX_FUZZ_EXAMPLES", "100"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
TRIED: Counter[str] = Counter()  # cases sent, by test and status (printed by the last test: -s shows it)


class ServerProcess:
    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=ENV)
        self.lines: list[str] = []
        self.up = threading.Event()
        self.url = ""
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace")
            self.lines.append(line)
            if not self.url and (m := re.search(r"Running on (http://\S+)", line)):
                self.url = m.group(1)
                self.up.set()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tiny_model_fp32, tmp_path_factory) -> Iterator[ServerProcess]:
    model = tmp_path_factory.mktemp("fuzz") / "short-context"
    shutil.copytree(tiny_model_fp32, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    srv = ServerProcess([*SERVE, str(model), "--port", "0", "--no-warmup", "--no-access-log",
                         "--max-n", str(MAX_N), "--max-body-bytes", "1000000", "--model-name", "fuzz",
                         "--default-max-tokens", str(DEFAULT_MAX_TOKENS)])
    try:
        assert srv.up.wait(60), "".join(srv.lines)
        yield srv
    finally:
        if srv.proc.poll() is None:
            srv.stop()


@pytest.fixture(scope="module")
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=20) as c:
        yield c


def _client_error_body(r: httpx.Response | Any, allow_ok: bool) -> dict[str, Any] | None:
    """Not a 5xx; the JSON body of a 4xx, with no traceback in it (None for an allowed 2xx)."""
    status = r.status_code
    assert status < 500, (status, r.text[:500])
    if allow_ok and status < 300:
        return None
    assert 400 <= status < 500, (status, r.text[:300])
    assert "Traceback" not in r.text
    return r.json()


def assert_openai_error(r: httpx.Response | Any, *, allow_ok: bool = False) -> None:
    """Not a 5xx; unless it is a 200, an OpenAI-shaped error body."""
    if (body := _client_error_body(r, allow_ok)) is not None:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def assert_anthropic_error(r: httpx.Response | Any, *, allow_ok: bool = False) -> None:
    """Not a 5xx; unless it is a 200, an Anthropic-shaped error body (the /v1/messages endpoints)."""
    if (body := _client_error_body(r, allow_ok)) is not None:
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body


# ---- schemathesis, from the server's own OpenAPI document -------------------------------------

schema = schemathesis.openapi.from_dict(openapi_document(Settings(model_name="fuzz", max_n=MAX_N), ROUTES))
schema.config.max_stream_events = 1000  # read streams whole (schemathesis stops at 20 events by default)
# A request the schema allows may still be refused for what it means (an unsupported value, a
# prompt longer than the context): a 400 there is right, so this one check does not apply.
NOT_APPLICABLE = [positive_data_acceptance]


@schema.parametrize()
@settings(FUZZ, max_examples=max(1, EXAMPLES // 3))
def test_the_api_from_its_openapi_document(case, server):
    response = case.call(base_url=server.url, timeout=20)
    TRIED[f"schemathesis {case.method} {case.path} -> {response.status_code}"] += 1
    case.validate_response(response, excluded_checks=NOT_APPLICABLE)
    if case.path.startswith("/v1/messages"):
        assert_anthropic_error(response, allow_ok=True)
    else:
        assert_openai_error(response, allow_ok=True)
    if response.status_code == 200 and case.method == "POST" and case.path in (CHAT, TEXT):
        if response.text.startswith(("data:", ":")):  # a stream
            assert response.text.endswith("data: [DONE]\n\n"), (json.dumps(case.body), response.text[-300:])
        else:
            assert response.json()["usage"]["completion_tokens"] >= 1


# ---- hypothesis: the request models over HTTP (the strategies are the unit layer's) -----------



@FUZZ
@given(obj=request_objects, chat=st.booleans())
def test_request_models_over_http(obj, chat, client):
    r = client.post(CHAT if chat else TEXT, json=obj)
    TRIED[f"models over HTTP -> {r.status_code}"] += 1
    assert_openai_error(r, allow_ok=True)


@settings(FUZZ, max_examples=max(1, EXAMPLES * 6 // 10))
@given(body=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()),
       ctype=st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain",
                              "application/x-www-form-urlencoded", None]))
def test_arbitrary_bytes_over_http(body, ctype, client):
    headers = {"content-type": ctype} if ctype else {}
    for path in (CHAT, TEXT):
        r = client.post(path, content=body, headers=headers)
        TRIED[f"arbitrary bytes -> {r.status_code}"] += 1
        assert_openai_error(r)


# ---- explicit cases ---------------------------------------------------------------------------

CHAT_OK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _cases() -> list[tuple[str, str, bytes, dict[str, str], bool]]:
    """(name, path, body, headers, may succeed)"""
    j = {"content-type": "application/json"}

    def body(**kw: Any) -> bytes:
        return json.dumps({**CHAT_OK, **kw}).encode()

    nested = b'{"messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    return [
        ("huge body (declared)", CHAT, b"x" * 1_500_000, j, False),
        ("invalid UTF-8 in a string", CHAT, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', j, False),
        ("invalid UTF-8 in a key", TEXT, b'{"\xff": 1, "prompt": "a"}', j, False),
        ("lone surrogate", TEXT, b'{"prompt": "\\ud800"}', j, True),
        ("UTF-8 BOM", TEXT, b'\xef\xbb\xbf{"prompt": "a", "max_tokens": 1}', j, True),
        ("text/plain", CHAT, body(), {"content-type": "text/plain"}, False),
        ("multipart", CHAT, body(), {"content-type": "multipart/form-data; boundary=x"}, False),
        ("deeply nested JSON", CHAT, nested, j, False),
        ("deeply nested objects", TEXT, b'{"prompt": ' + b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"}", j, False),
        ("max_tokens 10^12", CHAT, body(max_tokens=10**12), j, False),
        ("max_tokens 2^64", CHAT, body(max_tokens=2**64), j, False),
        ("an integer of 400 digits", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "seed": '
         + b"9" * 400 + b"}", j, False),
        ("NaN", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', j, False),
        ("Infinity", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', j, False),
        ("temperature 1e308", CHAT, body(temperature=1e308), j, False),
        ("negative temperature", CHAT, body(temperature=-0.5), j, False),
        ("top_k 10^9", CHAT, body(top_k=10**9), j, True),
        ("top_k -5", CHAT, body(top_k=-5), j, False),
        ("logit_bias key not a number", CHAT, body(logit_bias={"abc": 1}), j, False),
        ("logit_bias key negative", CHAT, body(logit_bias={"-1": 1}), j, False),
        ("logit_bias key past the vocabulary", CHAT, body(logit_bias={"99999999999": 1}), j, False),
        ("logit_bias key a float", CHAT, body(logit_bias={"1.5": 1}), j, False),
        ("logit_bias value 1e9", CHAT, body(logit_bias={"5": 1e9}), j, False),
        ("logit_bias of 10^5 keys", CHAT, body(logit_bias={str(i): 1 for i in range(100_000)}), j, False),
        ("n 10^9", CHAT, body(n=10**9), j, False),
        ("seed 2^64 - 1", CHAT, body(seed=2**64 - 1), j, True),
        ("seed 2^64", CHAT, body(seed=2**64), j, False),
        ("10^4 stop strings", CHAT, body(stop=["x"] * 10_000), j, False),
        ("top_logprobs 10^6", CHAT, body(logprobs=True, top_logprobs=10**6), j, False),
        ("prompt token ids past the vocabulary", TEXT, json.dumps({"prompt": [1, 2, 10**6]}).encode(), j, False),
        ("prompt token ids negative", TEXT, json.dumps({"prompt": [-1]}).encode(), j, False),
        ("prompt of 10^5 messages", CHAT, json.dumps({"messages": [{"role": "user", "content": "hi"}] * 10**5})
         .encode(), j, False),
        ("prompt far past the context", TEXT, json.dumps({"prompt": "word " * 50_000}).encode(), j, False),
        ("duplicate keys", TEXT, b'{"prompt": 1, "prompt": "a", "max_tokens": 1}', j, True),
        ("null bytes", TEXT, json.dumps({"prompt": "a\x00b", "max_tokens": 1}).encode(), j, True),
        ("stream_options without stream", CHAT, body(stream_options={"include_usage": True}), j, True),
        ("stream not a bool", CHAT, body(stream="yes"), j, False),
        ("empty body", CHAT, b"", j, False),
        ("JSON null", CHAT, b"null", j, False),
    ]


@pytest.mark.parametrize("name,path,body,headers,may_succeed", _cases(), ids=[c[0] for c in _cases()])
def test_explicit_bad_input(client, name, path, body, headers, may_succeed):
    r = client.post(path, content=body, headers=headers)
    TRIED[f"explicit -> {r.status_code}"] += 1
    assert_openai_error(r, allow_ok=may_succeed)
    if name.startswith("huge body"):
        assert r.status_code == 413


def test_a_huge_body_without_a_length_is_cut_at_the_limit(client):
    def chunks() -> Iterator[bytes]:  # chunked transfer encoding: no Content-Length to refuse early
        for _ in range(40):
            yield b"x" * 65536

    r = client.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_the_server_survived_and_logged_no_error(server, client):
    """Runs last in this module: after everything above, still healthy, and a clean log."""
    assert client.get("/health").status_code == 200
    r = client.post(CHAT, json={**CHAT_OK, "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    m = client.get("/metrics").text
    assert not re.search(r'trio_mlx_requests_total\{endpoint="[^"]*",status="5\d\d"\} [1-9]', m), m
    assert server.stop() == 0
    log = "".join(server.lines)
    assert not re.search(r"\bERROR\b|Traceback", log), log[-5000:]
    print("\nfuzz cases tried:", json.dumps(dict(sorted(TRIED.items())), indent=1), f"total {sum(TRIED.values())}")
