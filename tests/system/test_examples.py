"""Every script in examples/ runs: the HTTP ones against a live server (a tiny model), the
channel-API ones on the embedded default, each as a user would run it (its own process).
The openai SDK comes with the `examples` extra, which scripts/serve.sh installs."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser import ServerProcess

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# Seconds an example on the embedded default may take, its engine's start included: a first
# start on a fresh GPU machine compiles the warm-up's kernels for well over a minute. A limit,
# not a wait: on the CPU it finishes in seconds.
FIRST_START_S = 300


def run(script: str, *args: str, env: dict[str, str], timeout: float = 90) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def server(tiny_model_fp32) -> Iterator[ServerProcess]:
    s = ServerProcess(tiny_model_fp32, 0, "--model-name", "tiny-test", "--allow-multiple-workers")
    try:
        yield s
    finally:
        s.close()


def test_every_example_is_covered_here() -> None:
    covered = {"openai_client.py", "sse_client.py", "chat_stream.py", "concurrent_streams.py",
               "tools_and_json.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == covered


def test_openai_client(server) -> None:
    out = run("openai_client.py", "Hello", env={"OPENAI_BASE_URL": server.url + "/v1", "OPENAI_API_KEY": "x"})
    assert re.search(r"\[\d+ prompt \+ \d+ completion tokens\]", out), out
    assert re.search(r"\[\d+ tokens streamed\]", out), out


def test_sse_client(server) -> None:
    out = run("sse_client.py", "Tell me a story", env={"TRIO_MLX_URL": server.url})
    assert out.strip(), out


@pytest.mark.slow
@pytest.mark.timeout(FIRST_START_S + 30)
def test_chat_stream_on_the_embedded_default(embedded_model) -> None:
    out = run("chat_stream.py", "What is the capital of France?",
              env={"TRIO_MLX_CACHE_DIR": str(embedded_model.parent)}, timeout=FIRST_START_S)
    assert re.search(r"\[(stop|length); \d+ prompt \+ \d+ completion tokens\]", out), out


def test_concurrent_streams(tiny_model_fp32) -> None:
    out = run("concurrent_streams.py", str(tiny_model_fp32), env={})
    assert "(cancelled by the client)" in out or "(abort" in out or "cancelled" in out, out
    assert re.search(r"\d+ requests, \d+ aborted, \d+ tokens in \d+ decode steps", out), out


def test_tools_and_json(tool_model_fp32) -> None:
    """On a model whose template has tools: a JSON answer in the schema, then a tool call."""
    out = run("tools_and_json.py", str(tool_model_fp32), env={})
    answer = ast.literal_eval(out.split("JSON answer:", 1)[1].splitlines()[0].strip())  # a printed dict
    assert set(answer) == {"city", "country", "population"}, out
    assert re.search(r"tool call \S+: get_weather\(\{.*\}\)", out), out
    # a random model's arguments may run to max_tokens: the grammar closes them ("length")
    assert re.search(r"finish_reason: (tool_calls|length)", out), out
