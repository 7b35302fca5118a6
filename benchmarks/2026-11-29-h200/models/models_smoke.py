"""`trio-mlx serve --models DIR --max-loaded-models 2` with two models a and b: loads on first
use, then streams on one model, on both at once, and each alone; each request's decode tok/s.

    MM_DIR=/tmp/mm PYTHONPATH=. python models_smoke.py   (DIR holds model folders a and b)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import trio

PORT = 8011


async def one(client: httpx.AsyncClient, model: str, results: list[tuple[Any, ...]]) -> None:
    t0 = time.perf_counter()
    first, n = None, 0
    body = {"model": model, "prompt": "hello " * 60, "max_tokens": 128, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                d = json.loads(line[6:])
                if d.get("usage"):
                    n = d["usage"]["completion_tokens"]
                elif first is None:
                    first = time.perf_counter()
        rate = (n - 1) / (time.perf_counter() - first) if first and n > 1 else 0
        results.append((model, r.status_code, n, rate, (first or t0) - t0))


async def requests() -> None:
    plans = (("a alone (loads a)", ["a"]), ("b alone (loads b)", ["b"]), ("a x4", ["a"] * 4),
             ("a x4 + b x4", ["a", "b"] * 4), ("a x1 + b x1", ["a", "b"]), ("a x1", ["a"]))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=300) as client:
        for label, plan in plans:
            results: list[tuple[Any, ...]] = []
            t0 = time.perf_counter()
            async with trio.open_nursery() as n:
                for model in plan:
                    n.start_soon(one, client, model, results)
            per = {m: [round(r[3]) for r in results if r[0] == m] for m in set(plan)}
            print(label, f"wall {time.perf_counter() - t0:.2f} s", "statuses", sorted({r[1] for r in results}),
                  "chunks", sorted({r[2] for r in results}), "decode tok/s per request", per,
                  f"ttft max {max(r[4] for r in results):.2f}", flush=True)
        models = (await client.get("/v1/models")).json()["data"]
        print("models", [(m["id"], m.get("state")) for m in models], flush=True)


def main() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "trio_mlx.cli", "serve", "--models",
                             os.environ.get("MM_DIR", "/tmp/mm"), "--max-loaded-models", "2", "--port", str(PORT),
                             "--no-access-log"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    up, lines = threading.Event(), []

    def pump() -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            lines.append(raw.decode(errors="replace"))
            if "Running on" in lines[-1]:
                up.set()

    threading.Thread(target=pump, daemon=True).start()
    assert up.wait(200), "".join(lines[-30:])
    trio.run(requests)
    proc.terminate()
    print("exit", proc.wait(60))
    print("".join(line for line in lines if "actor host" in line or "ERROR" in line or "Traceback" in line))


if __name__ == "__main__":
    main()
