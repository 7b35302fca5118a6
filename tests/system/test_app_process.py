"""The server as a process: `trio-mlx serve` draining on SIGTERM (and keeping its exit status when
another comes while it exits), exit codes at startup, and
`hypercorn -k trio trio_mlx.app:app` serving the embedded default. The other ASGI servers, and
the same properties under each, are in test_asgi_servers.py."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio
from processes import ENV, HYPERCORN, SERVE, alive, start


async def stream_all(client: httpx.AsyncClient, body: dict, out: dict, key: str, started: trio.Event) -> None:
    raw = b""
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        out[key + "_status"] = resp.status_code
        async for chunk in resp.aiter_raw():
            raw += chunk
            if b"data: " in raw:
                started.set()
    out[key] = [json.loads(e[6:]) if e != b"data: [DONE]" else "[DONE]"
                for e in raw.strip().split(b"\n\n") if e.startswith(b"data: ")]


@pytest.mark.parametrize("actor", ["thread", "process"])
async def test_sigterm_drains_then_exits_zero(tiny_model_fp32, actor):
    async with trio.open_nursery() as nursery:
        p = await start(nursery, [*SERVE, str(tiny_model_fp32), "--port", "0", "--no-warmup",
                                  "--drain-timeout", "0.3", "--no-access-log", "--actor", actor])
        with trio.fail_after(30):
            await p.has_url.wait()
        out: dict = {}
        async with httpx.AsyncClient(base_url=p.url, timeout=20) as client:
            health = (await client.get("/health")).json()
            assert health["actor"] == actor
            assert (health["actor_pid"] == p.proc.pid) == (actor == "thread")
            long_started, short_started = trio.Event(), trio.Event()
            msgs = [{"role": "user", "content": "hi"}]
            async with trio.open_nursery() as clients:
                clients.start_soon(stream_all, client, {"messages": msgs, "max_tokens": 950, "stream": True,
                                                        "ignore_eos": True}, out, "long", long_started)
                clients.start_soon(stream_all, client, {"messages": msgs, "max_tokens": 30, "stream": True,
                                                        "ignore_eos": True}, out, "short", short_started)
                with trio.fail_after(10):
                    await long_started.wait()
                    await short_started.wait()
                p.proc.send_signal(signal.SIGTERM)
                with trio.fail_after(5):
                    while (await client.get("/ready")).status_code != 503:  # noqa: ASYNC110
                        await trio.sleep(0.01)
                r = await client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
                assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
            with trio.fail_after(20):
                rc = await p.proc.wait()
        assert rc == 0, p.text[-3000:]
        # the short request finished normally during the drain; the long one was ended by it
        assert out["short"][-1] == "[DONE]" and out["short"][-2]["choices"][0]["finish_reason"] == "length"
        assert out["long"][-1] == "[DONE]" and out["long"][-2]["error"]["code"] == "aborted"
        assert "SIGTERM: draining" in p.text
        assert not alive(health["actor_pid"])  # a process actor stopped with its server
        nursery.cancel_scope.cancel()


# `trio-mlx serve` whose exit lingers in an atexit handler, as a process does while its threads
# join (a distributed rank's exit waits up to its watchdog's grace).
LINGERING = ("import atexit, sys, time\n"
             "from trio_mlx.server._serve import main\n"
             "atexit.register(lambda: (print('lingering at exit', file=sys.stderr, flush=True), time.sleep(20)))\n"
             "sys.exit(main(sys.argv[1:]))\n")


async def sigterm_twice(script: str, model) -> tuple[int, str]:
    """Start `script` serving `model`; SIGTERM it once ready, again once it lingers at exit; its
    exit status (within 10 s of the second, not the atexit handler's 20) and its log."""
    async with trio.open_nursery() as nursery:
        p = await start(nursery, [sys.executable, "-c", script, str(model), "--port", "0",
                                  "--no-warmup", "--no-access-log"])
        with trio.fail_after(30):
            await p.has_url.wait()
        p.proc.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            while "lingering at exit" not in p.text:  # noqa: ASYNC110 - a log line
                await trio.sleep(0.02)
        p.proc.send_signal(signal.SIGTERM)
        with trio.fail_after(10):
            rc = await p.proc.wait()
        nursery.cancel_scope.cancel()
    return rc, p.text


async def test_a_sigterm_once_the_drain_is_over_keeps_the_exit_status(tiny_model_fp32):
    """A second SIGTERM while the process exits (mlx.launch sends one to every rank left once
    one failed) must not turn its status into death by the signal: it exits with it at once."""
    rc, text = await sigterm_twice(LINGERING, tiny_model_fp32)
    assert rc == 0, text[-3000:]


# The same, with an engine that failed for good while its actor thread went on (a distributed
# group that lost a rank: `Engine.fail`), as a rank whose launcher sends SIGTERM after SIGTERM:
# the actor returns once the drain began (the other rank's end broke its collective), and the
# app's watch for a broken engine, cancelled with the drain, never sees it.
FAILED_LINGERING = ("import atexit, sys, time\n"
                    "import trio\n"
                    "from trio_mlx.actor import Shutdown\n"
                    "from trio_mlx.engine import _engine\n"
                    "from trio_mlx.server import _app\n"
                    "from trio_mlx.server._serve import main\n"
                    "_start, _close = _app.TrioMLXApp.start_engine, _engine.Engine.aclose\n"
                    "async def start_engine(self):\n"
                    "    await _start(self)\n"
                    "    self.engine.fail('the distributed group failed: a test')\n"
                    "async def aclose(self, **kw):\n"
                    "    try:\n"
                    "        self._registry.to_actor(Shutdown())\n"
                    "    except trio.ClosedResourceError:\n"
                    "        pass\n"
                    "    await _close(self, **kw)\n"
                    "async def unwatched(app, engine):\n"
                    "    await trio.sleep_forever()\n"
                    "_app.TrioMLXApp.start_engine, _engine.Engine.aclose = start_engine, aclose\n"
                    "_app._exit_when_broken = unwatched\n"
                    + LINGERING.split("\n", 2)[2])


async def test_a_failed_engine_exits_1_through_a_launchers_sigterms(tiny_model_fp32):
    """A server whose engine failed exits 1 though a SIGTERM stopped it and another came while
    it exited (mlx.launch terminates a rank again and again once another rank is gone)."""
    rc, text = await sigterm_twice(FAILED_LINGERING, tiny_model_fp32)
    assert rc == 1, text[-3000:]


def test_a_model_that_cannot_load_exits_nonzero_with_the_reason(tmp_path):
    missing = tmp_path / "no-such-model"
    proc = subprocess.run([*SERVE, str(missing), "--port", "0"], capture_output=True, text=True,
                          timeout=60, env=ENV)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "could not start" in proc.stderr and "no such model directory" in proc.stderr


def test_bad_settings_exit_2_naming_the_variable():
    proc = subprocess.run([*SERVE, "--port", "0"], capture_output=True, text=True, timeout=60,
                          env={**ENV, "TRIO_MLX_MAX_BATCH": "lots"})
    assert proc.returncode == 2 and "TRIO_MLX_MAX_BATCH" in proc.stderr, proc.stderr
    proc = subprocess.run([*SERVE, "--stall-timeout", "-1"], capture_output=True, text=True, timeout=60, env=ENV)
    assert proc.returncode == 2 and "stall_timeout" in proc.stderr, proc.stderr


# Seconds a server of the embedded default may take to start: a first start on a fresh GPU
# machine compiles the warm-up's kernels for well over a minute (seconds on the CPU).
FIRST_START_S = 300


@pytest.mark.slow
@pytest.mark.timeout(FIRST_START_S + 60)
async def test_hypercorn_trio_worker_serves_the_embedded_default(embedded_model):
    env = {**ENV, "TRIO_MLX_CACHE_DIR": str(Path(embedded_model).parent)}
    env.pop("TRIO_MLX_MODEL", None)
    async with trio.open_nursery() as nursery:
        p = await start(nursery, [*HYPERCORN, "-k", "trio", "-b", "127.0.0.1:0", "trio_mlx.app:app"], env=env)
        with trio.fail_after(FIRST_START_S):  # ready first, then the request on its own limit
            await p.has_url.wait()
        async with httpx.AsyncClient(base_url=p.url, timeout=60) as client:
            models = (await client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["smollm2-135m-instruct"]
            r = await client.post("/v1/chat/completions", json={
                "model": "smollm2-135m-instruct", "max_tokens": 20, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            assert r.status_code == 200, r.text
            assert "Paris" in r.json()["choices"][0]["message"]["content"]
        p.proc.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            await p.proc.wait()
        assert not re.search(r"Traceback|terminate called", p.text), p.text[-3000:]
        nursery.cancel_scope.cancel()
