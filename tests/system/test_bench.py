"""`trio-mlx bench`: statistics, SSE and HTTP parsing, prompts, the --limit ceiling, plots and
tables, and the HTTP mode against real servers on 127.0.0.1 (a fake SSE server in-process, and
mlx_lm.server in a subprocess).

Here the HTTP and paired modes against mlx_lm.server in a subprocess; the rest:
tests/unit/test_bench.py and tests/integration/test_bench.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trio_mlx.bench import _cli as _bench
from trio_mlx.bench import _sweep
from trio_mlx.bench._stats import (
    format_table,
)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_fp32: Path) -> Path:
    return tiny_model_fp32


# ------------------------------------------------------- HTTP mode, real servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def mlx_lm_server(tiny_model: Path) -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "server",
            "--model",
            str(tiny_model),
            "--port",
            str(port),
            "--decode-concurrency",
            "8",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            try:
                if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "mlx_lm.server did not come up in 60 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("client", ["raw", "httpx"])
def test_http_mode_against_mlx_lm_server(
    client: str, mlx_lm_server: str, tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "http.json"
    # "default_model" is mlx_lm.server's name for its --model; at most 4 in
    # flight because its listen backlog is 5 (bursts beyond it get resets).
    rc = _bench.main(
        [
            "--url",
            mlx_lm_server,
            "--model",
            str(tiny_model),
            "--served-model-name",
            "default_model",
            "--client",
            client,
            "--concurrency",
            "1,4",
            "--requests-per-level",
            "4",
            "--prompt-tokens",
            "24",
            "--max-tokens",
            "8",
            "--out",
            str(out),
            "--quiet",
            "--timeout",
            "30",
        ]
    )
    res = json.loads(out.read_text())
    for lv in res["levels"]:
        assert lv["errors"] == {"total": 0, "by_reason": {}, "samples": {}}
        assert lv["requests"] == lv["completed"] == 4
        assert lv["output_tokens"] == 4 * 8
        assert 0 < lv["ttft_ms"]["p50"] < lv["e2e_ms"]["p50"]
        assert lv["tpot_ms"]["n"] == 4
    assert rc == 0


@pytest.mark.timeout(120)
def test_paired_mode_interleaves_the_ceiling_with_the_server(
    mlx_lm_server: str, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trio_mlx.actor import _ceiling as _bench_limit

    order: list[tuple[str, int]] = []
    drive, run_level = _bench_limit.Ceiling.drive, _sweep._run_level

    def logged_drive(self: Any, prompts: Any, concurrency: int, max_tokens: int, *rest: Any) -> Any:
        order.append(("ceiling", len(prompts)))
        return drive(self, prompts, concurrency, max_tokens, *rest)

    async def logged_level(client: Any, path: str, bodies: list[bytes], *a: Any) -> Any:
        order.append(("server", len(bodies)))
        return await run_level(client, path, bodies, *a)

    monkeypatch.setattr(_bench_limit.Ceiling, "drive", logged_drive)
    monkeypatch.setattr(_sweep, "_run_level", logged_level)
    out, ceiling = tmp_path / "server.json", tmp_path / "ceiling.json"

    def paired(*args: str) -> int:
        """`trio-mlx bench --paired` against the server, 8-token answers to 24-token prompts."""
        return _bench.main(
            ["--url", mlx_lm_server, "--paired", str(ceiling), "--model", str(tiny_model),
             "--served-model-name", "default_model", "--prompt-tokens", "24", "--max-tokens", "8",
             "--warmup", "2", "--out", str(out), "--quiet", "--timeout", "30", *args]
        )  # fmt: skip

    rc = paired("--concurrency", "1,4", "--requests-per-level", "6", "--label", "srv")
    assert rc == 0
    # each level: ceiling, server, server, ceiling on the halves of its 6 requests
    assert order == [("ceiling", 3), ("server", 3), ("server", 3), ("ceiling", 3)] * 2
    srv, lim = json.loads(out.read_text()), json.loads(ceiling.read_text())
    assert lim["target"] == "limit" and lim["label"] == "srv ceiling (paired)" and lim["paired_with"] == mlx_lm_server
    for res in (srv, lim):
        assert [lv["concurrency"] for lv in res["levels"]] == [1, 4]
        for lv in res["levels"]:
            assert lv["requests"] == lv["completed"] == 6 and lv["output_tokens"] == 6 * 8
    table = format_table([srv], lim)
    assert "| srv | c=4 |" in table and "| - |" not in table  # every level has its ceiling
    # --paired-rounds 3: c=1 in three rounds of one request a side; c=4 has too few
    # requests for chunks of 4, so it keeps one round
    order.clear()
    rc = paired("--paired-rounds", "3", "--concurrency", "1,4", "--requests-per-level", "6")
    assert rc == 0
    assert order == [("ceiling", 1), ("server", 1), ("server", 1), ("ceiling", 1)] * 3 + \
        [("ceiling", 3), ("server", 3), ("server", 3), ("ceiling", 3)]
    for res in (json.loads(out.read_text()), json.loads(ceiling.read_text())):
        assert [(lv["requests"], lv["completed"]) for lv in res["levels"]] == [(6, 6), (6, 6)]
    # --ceiling bare: the bare forward's waves of c rows take the ceiling's turns instead
    bare = _bench_limit.Ceiling.bare
    waves: list[int] = []

    def logged_bare(self: Any, prompts: Any, max_tokens: int) -> Any:
        waves.append(len(prompts))
        return bare(self, prompts, max_tokens)

    monkeypatch.setattr(_bench_limit.Ceiling, "bare", logged_bare)
    order.clear()
    rc = paired("--ceiling", "bare", "--concurrency", "1,2", "--requests-per-level", "4")
    assert rc == 0
    assert [o for o in order if o[0] == "ceiling"] == []  # no BatchGenerator ran
    assert waves == [1, 1, 1, 1, 2, 2]  # c=1: a wave per request; c=2: one of two per chunk
    lim = json.loads(ceiling.read_text())
    assert [(lv["ceiling"], lv["completed"], lv["output_tokens"]) for lv in lim["levels"]] == [
        ("bare", 4, 32), ("bare", 4, 32)]
