"""The server as a process under faults: SIGTERM under load in both drain modes loses no completed
response; a SIGKILLed server restarts clean, and so does a model conversion SIGKILLed mid-way."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from app_server import CHAT, COMPLETIONS, HELLO, Scrape, until_answer
from processes import ENV, start

from trio_mlx import ModelLoadError
from trio_mlx.models import _models

SLOW_SERVER = [sys.executable, str(Path(__file__).resolve().parents[1] / "slow_server.py")]
SHORT, LONG = 30, 600  # tokens; at 10 ms a step a long one outlasts any drain timeout used here


def jobs() -> list[tuple[str, str, dict[str, Any]]]:
    out = []
    for i in range(12):
        tokens = SHORT if i % 2 else LONG
        if i % 4 < 2:
            path, body = CHAT, {"messages": HELLO}
        else:
            path, body = COMPLETIONS, {"prompt": f"job {i}"}
        body = {**body, "max_tokens": tokens, "ignore_eos": True, "stream": i % 3 != 0}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        out.append((f"job{i}", path, body))
    return out


async def run_job(client: httpx.AsyncClient, path: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    if body["stream"]:
        raw = b""
        async with client.stream("POST", path, json=body) as resp:
            out["status"] = resp.status_code
            async for chunk in resp.aiter_raw():
                raw += chunk
        out["events"] = [json.loads(e[6:]) if e != b"data: [DONE]" else "[DONE]"
                         for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    else:
        r = await client.post(path, json=body)
        out["status"], out["json"] = r.status_code, r.json()
    out["ended"] = trio.current_time()


def verdict(body: dict[str, Any], out: dict[str, Any]) -> str:
    """"complete" (and then correct) or "aborted" (with a terminal event); anything else fails."""
    if body["stream"]:
        events = out["events"]
        assert out["status"] == 200 and events[-1] == "[DONE]", events[-3:]  # never cut short
        if "error" in events[-2]:
            assert events[-2]["error"]["code"] == "aborted", events[-2]
            return "aborted"
        assert events[-2]["usage"]["completion_tokens"] == body["max_tokens"], events[-2]
        assert events[-3]["choices"][0]["finish_reason"] == "length"
        return "complete"
    if out["status"] == 503:
        assert out["json"]["error"]["code"] == "aborted", out
        return "aborted"
    assert out["status"] == 200, out
    assert out["json"]["usage"]["completion_tokens"] == body["max_tokens"]
    assert out["json"]["choices"][0]["finish_reason"] == "length"
    return "complete"


@pytest.mark.parametrize("drain", [2.0, 0.0], ids=["drain", "no-drain"])
async def test_sigterm_under_load_loses_no_completed_response(tiny_model_fp32, drain):
    work = jobs()
    results: dict[str, dict[str, Any]] = {key: {} for key, *_ in work}
    async with trio.open_nursery() as nursery:
        p = await start(nursery, [*SLOW_SERVER, "0.01", str(tiny_model_fp32), "--port", "0", "--no-warmup",
                                  "--drain-timeout", str(drain), "--no-access-log"])
        with trio.fail_after(30):
            await p.has_url.wait()
        assert p.url is not None
        async with httpx.AsyncClient(base_url=p.url, timeout=30, limits=httpx.Limits(max_connections=32)) \
                as client:
            async with trio.open_nursery() as clients:
                for key, path, body in work:
                    clients.start_soon(run_job, client, path, body, results[key])

                async def metrics() -> Scrape:
                    return Scrape((await client.get("/metrics")).text)

                await until_answer(metrics, lambda m: m.value("trio_mlx_requests_in_engine", stage="decode")
                                   == len(work), within=10)
                p.proc.send_signal(signal.SIGTERM)
                signalled = trio.current_time()
                if drain:
                    r = await client.post(CHAT, json={"messages": HELLO, "max_tokens": 2})
                    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
        with trio.fail_after(drain + 15):
            rc = await p.proc.wait()
        nursery.cancel_scope.cancel()
    assert rc == 0, p.text[-3000:]
    verdicts = {key: verdict(body, results[key]) for key, _, body in work}
    for key, _, body in work:
        if drain:  # short ones finish inside the drain; long ones are ended by it
            assert verdicts[key] == ("complete" if body["max_tokens"] == SHORT else "aborted"), key
        else:  # everything in flight ended at once, with a terminal event
            assert verdicts[key] == "aborted", key
            assert results[key]["ended"] - signalled < 2.0
    assert "Traceback" not in p.text, p.text[-3000:]


def visible_dirs(cache: Path) -> list[Path]:
    """Model directories (not hidden partial ones, nor blas/: models/_cpu_blas.py's OpenBLAS copy)."""
    return [d for d in cache.iterdir() if not d.name.startswith(".") and d.name != "blas"] if cache.exists() else []


@pytest.mark.slow
async def test_a_conversion_killed_midway_is_never_published_and_the_next_one_is_clean(tmp_path):
    cache = tmp_path / "cache"
    env = {**ENV, "TRIO_MLX_CACHE_DIR": str(cache)}
    code = "from trio_mlx.models import _models; _models.ensure_embedded_model()"
    proc = await trio.lowlevel.open_process([sys.executable, "-c", code], env=env)
    try:
        with trio.fail_after(60):
            while not (cache.exists() and any(cache.glob(".*.partial"))):  # noqa: ASYNC110 - no event for a dir
                if proc.poll() is not None:
                    pytest.fail(f"the conversion ended (rc {proc.returncode}) before it could be killed")
                await trio.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
    finally:
        with trio.fail_after(10):
            rc = await proc.wait()
    assert rc == -signal.SIGKILL
    # killed mid-way: the half-written copy stays hidden; nothing was published under the model's name
    [partial] = cache.glob(".*.partial")
    assert not (partial / "config.json").exists()
    assert visible_dirs(cache) == []
    with pytest.raises(ModelLoadError):
        _models.resolve_model(partial)
    # the next start converts cleanly beside the leftover, and what it publishes loads
    path = await trio.to_thread.run_sync(_models.ensure_embedded_model, cache)
    assert visible_dirs(cache) == [path]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(path))
    assert _models.resolve_model(path) == path
    await trio.to_thread.run_sync(_models.load_tokenizer, path)


async def test_a_killed_server_restarts_clean(tiny_model_fp32):
    args = [*SLOW_SERVER, "0.01", str(tiny_model_fp32), "--port", "0", "--no-warmup", "--no-access-log"]
    async with trio.open_nursery() as nursery:
        p = await start(nursery, args)
        with trio.fail_after(30):
            await p.has_url.wait()
        async with httpx.AsyncClient(base_url=p.url or "", timeout=30) as client:
            started = trio.Event()

            async def stream() -> None:
                body = {"messages": HELLO, "max_tokens": 900, "ignore_eos": True, "stream": True}
                try:
                    async with client.stream("POST", CHAT, json=body) as resp:
                        async for _ in resp.aiter_raw():
                            started.set()
                except httpx.HTTPError:
                    pass  # the server died under it: expected

            async with trio.open_nursery() as clients:
                for _ in range(4):
                    clients.start_soon(stream)
                with trio.fail_after(10):
                    await started.wait()
                p.proc.send_signal(signal.SIGKILL)
        with trio.fail_after(10):
            assert await p.proc.wait() == -signal.SIGKILL

        # The same command again: not locked out by the dead process, nothing left over, serving.
        p = await start(nursery, args)
        with trio.fail_after(30):
            await p.has_url.wait()
        async with httpx.AsyncClient(base_url=p.url or "", timeout=30) as client:
            assert (await client.get("/ready")).status_code == 200
            r = await client.post(CHAT, json={"messages": HELLO, "max_tokens": 5, "ignore_eos": True})
            assert r.json()["usage"]["completion_tokens"] == 5
            m = Scrape((await client.get("/metrics")).text)
            assert m.value("trio_mlx_active_sequences") == m.value("trio_mlx_queue_depth") == 0
            assert m.value("trio_mlx_engine_requests_submitted_total") == 1
        p.proc.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await p.proc.wait() == 0
        assert "Traceback" not in p.text and "ERROR" not in p.text, p.text[-3000:]
        nursery.cancel_scope.cancel()
