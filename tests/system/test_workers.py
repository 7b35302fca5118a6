"""Several hypercorn workers would each load the model onto the same device: refused at startup with a
clear line and a non-zero exit, unless TRIO_MLX_ALLOW_MULTIPLE_WORKERS=1. The guard is a per-model/device
file lock. (The same refusal under the other ASGI servers: test_asgi_servers.py.)

Here server processes; the lock's key and its sharing: tests/unit/test_workers.py.
"""

from __future__ import annotations

import re
import signal
import subprocess

import httpx
import trio
from processes import ENV, HYPERCORN, SERVE, start

REFUSED = "another trio_mlx server process (pid "


def worker_env(model, **extra: str) -> dict[str, str]:
    return {**ENV, "TRIO_MLX_MODEL": str(model), "TRIO_MLX_WARMUP": "0", **extra}


def test_two_hypercorn_workers_are_refused_in_one_line(tiny_model_fp32):
    proc = subprocess.run([*HYPERCORN, "-k", "trio", "-w", "2", "-b", "127.0.0.1:0", "trio_mlx.app:app"],
                          capture_output=True, text=True, timeout=60, env=worker_env(tiny_model_fp32))
    # The refused worker stops the other one and kills hypercorn's supervisor, which would exit 0
    # whatever its workers did (hypercorn issue #269), then exits 3 itself (trio_mlx/_exit.py).
    assert proc.returncode == -9, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if REFUSED in line]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "TRIO_MLX_ALLOW_MULTIPLE_WORKERS=1" in lines[0]
    assert "Traceback" not in proc.stderr, proc.stderr


async def test_two_workers_serve_when_explicitly_allowed(tiny_model_fp32):
    env = worker_env(tiny_model_fp32, TRIO_MLX_ALLOW_MULTIPLE_WORKERS="1")
    async with trio.open_nursery() as nursery:
        p = await start(nursery, [*HYPERCORN, "-k", "trio", "-w", "2", "-b", "127.0.0.1:0", "trio_mlx.app:app"],
                        env=env)
        with trio.fail_after(60):
            while len(re.findall(r"\[(\d+)\] \[INFO\] Running on", p.text)) < 2:  # noqa: ASYNC110 - log lines
                await trio.sleep(0.05)
        assert len(set(re.findall(r"\[(\d+)\] \[INFO\] Running on", p.text))) == 2  # two worker processes
        async with httpx.AsyncClient(base_url=p.url or "", timeout=30) as client:
            for _ in range(4):
                r = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2},
                                      headers={"Connection": "close"})
                assert r.status_code == 200, r.text
        p.proc.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            await p.proc.wait()
        assert REFUSED not in p.text
        nursery.cancel_scope.cancel()


async def test_a_second_server_process_for_the_same_model_is_refused(tiny_model_fp32):
    """Not only hypercorn workers: any second process serving this model on this device."""
    async with trio.open_nursery() as nursery:
        first = await start(nursery, [*SERVE, str(tiny_model_fp32), "--port", "0", "--no-warmup"])
        with trio.fail_after(30):
            await first.has_url.wait()
        second = await trio.run_process([*SERVE, str(tiny_model_fp32), "--port", "0", "--no-warmup"],
                                        capture_stderr=True, check=False, env=ENV)
        err = second.stderr.decode()
        assert second.returncode == 1 and "could not start" in err and REFUSED in err, err
        assert f"(pid {first.proc.pid})" in err
        allowed = await trio.run_process([*SERVE, str(tiny_model_fp32), "--port", "0", "--no-warmup",
                                          "--allow-multiple-workers", "--startup-timeout", "0.001"],
                                         capture_stderr=True, check=False, env=ENV)
        assert REFUSED not in allowed.stderr.decode()  # allowed: it got past the lock (then timed out)
        first.proc.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await first.proc.wait() == 0
        nursery.cancel_scope.cancel()
