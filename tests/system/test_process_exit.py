"""A process that used the engine exits with status 0, every time.

MLX can abort at interpreter exit ("terminate called without an active
exception") when a non-main thread leaves arrays behind, so this runs real
processes many times: normal close, close with requests in flight, and a
cancelled program.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import sys, trio, trio_mlx

async def main(model, mode):
    async with trio_mlx.open_engine(model, max_batch=8) as engine:
        async def one(i):
            async with engine.generate(f"run {i}", max_tokens=400 if mode != "normal" else 8, ignore_eos=True) as events:
                async for _ in events:
                    pass
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(one, i)
            if mode == "cancel":
                await trio.sleep(0.05)
                nursery.cancel_scope.cancel()
            elif mode == "close":
                await trio.sleep(0.05)
                await engine.aclose()
    print("clean exit", flush=True)

trio.run(main, sys.argv[1], sys.argv[2])
"""

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["normal", "close", "cancel"])
def test_process_exits_zero_every_time(tiny_model_fp32, mode):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    runs, at_once = 4, 2  # two at a time: each is mostly a single-threaded start-up (~2.5 CPU s)

    def run(i: int) -> tuple[int, subprocess.CompletedProcess[str]]:
        return i, subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_fp32), mode],
                                 capture_output=True, text=True, timeout=60, env=env)

    with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
        for i, proc in pool.map(run, range(runs)):
            assert proc.returncode == 0, f"run {i} ({mode}) exited {proc.returncode}:\n{proc.stderr[-2000:]}"
            assert "clean exit" in proc.stdout
            assert "terminate called" not in proc.stderr
