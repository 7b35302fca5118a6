"""`trio-mlx serve --models DIR` as a process: models load as requests name them, one unloaded
for another under `--max-loaded-models` (or on request), /metrics by model, and SIGTERM drains the loaded ones, refuses the rest
(no model loads during a drain) and exits 0. The HTTP layer over the fake actor:
tests/unit/test_app_models.py; the pool itself: tests/unit/test_model_pool.py and
tests/integration/test_model_pool.py."""

from __future__ import annotations

import re
import signal

import httpx
import trio
from processes import SERVE, start

from trio_mlx.models import _test_models


async def test_a_folder_of_models_served_loaded_on_demand_and_drained(tmp_path):
    folder = tmp_path / "models"
    for name, seed in (("one", 1), ("two", 2)):
        _test_models.build_test_model(folder / name, seed=seed)
    msgs = [{"role": "user", "content": "hi"}]
    async with trio.open_nursery() as nursery:
        p = await start(nursery, [*SERVE, "--models", str(folder), "--max-loaded-models", "1", "--port", "0",
                                  "--no-warmup", "--drain-timeout", "5", "--no-access-log"])
        with trio.fail_after(30):
            await p.has_url.wait()
        async with httpx.AsyncClient(base_url=p.url, timeout=20) as client:
            assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == ["one", "two"]
            for name in ("one", "two"):
                # ignore_eos: a sampled random model may stop early, and the count below is exact
                r = await client.post("/v1/chat/completions", json={"model": name, "messages": msgs,
                                                                      "max_tokens": 4, "ignore_eos": True})
                assert r.status_code == 200 and r.json()["model"] == name, r.text
            models = (await client.get("/health")).json()["models"]
            assert models == {"one": {"state": "unloaded", "in_flight": 0}, "two": {"state": "loaded", "in_flight": 0}}
            metrics = (await client.get("/metrics")).text  # the real actor's figures, by model
            assert 'trio_mlx_engine_generated_tokens_total{model="two"} 4.0' in metrics, metrics
            assert 'trio_mlx_queue_depth{model="two"} 0.0' in metrics
            assert 'trio_mlx_queue_depth{model="one"}' not in metrics  # unloaded: no series
            r = await client.post("/models/unload", json={"model": "two"})  # idle: unloaded now, and loaded again on demand
            assert r.status_code == 200 and r.json()["unloaded"] is True, r.text
            assert (await client.get("/health")).json()["models"]["two"]["state"] == "unloaded"
            r = await client.post("/v1/chat/completions", json={"model": "two", "messages": msgs, "max_tokens": 2})
            assert r.status_code == 200, r.text
            done = trio.Event()
            out: dict = {}

            async def long() -> None:
                r = await client.post("/v1/chat/completions", json={"model": "two", "messages": msgs,
                                                                      "max_tokens": 300, "ignore_eos": True})
                out["long"] = r
                done.set()

            nursery.start_soon(long)
            with trio.fail_after(10):
                while (await client.get("/health")).json()["models"]["two"]["in_flight"] == 0:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            p.proc.send_signal(signal.SIGTERM)
            with trio.fail_after(5):
                while (await client.get("/ready")).status_code != 503:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            r = await client.post("/v1/chat/completions", json={"model": "one", "messages": msgs, "max_tokens": 2})
            assert r.status_code == 503 and "retry-after" in r.headers, r.text  # refused, not loaded
            with trio.fail_after(20):
                await done.wait()
            assert out["long"].status_code == 200 and out["long"].json()["choices"][0]["finish_reason"] == "length"
            with trio.fail_after(20):
                rc = await p.proc.wait()
        assert rc == 0, p.text[-3000:]
        assert "loading the model 'one'" in p.text and len(re.findall(r"(?<!un)loading the model 'two'", p.text)) == 2
        assert "unloading the model 'two' (asked for)" in p.text
        assert "unloading the model 'one' (least recently used, idle) to load 'two'" in p.text
        nursery.cancel_scope.cancel()
