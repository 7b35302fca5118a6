"""Two replicas of the tiny model behind sglang-router's cache-aware policy (docs/distributed.md,
"Scaling out"): both started on this one CPU with `--replica` names of their own (no lock
override); the router names their model from `/server_info` and health-checks `/ready`. The
turns of each conversation land on the replica that holds their prefix (cached tokens on every
follow-up), streaming and the Responses API pass through, and once the router has noticed a
replica killed, its traffic goes to the other with no request lost.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import socket
import sys
import warnings
from pathlib import Path

import httpx
import pytest
import trio
from processes import ENV, SERVE, Proc, start

pytestmark = pytest.mark.timeout(180)  # three starts of the router at the most, 30 s each

ROUTER = shutil.which("sglang-router", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                             os.environ.get("PATH", "")]))
CHAT = "/v1/chat/completions"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _served(p: Proc) -> int:
    """Chat completions this replica answered, from its access log."""
    return p.text.count(f'"POST {CHAT} 1.1" 200')


def _conversation(client: httpx.Client, n: int, turns: int = 3) -> list[int]:
    """One conversation's turns, each resending the whole history: the cached tokens of each turn."""
    messages = [{"role": "system", "content": f"Conversation {n}. " + " ".join(f"c{n}w{i}" for i in range(60))},
                {"role": "user", "content": "Begin."}]
    cached = []
    for turn in range(turns):
        r = client.post(CHAT, json={"model": "model", "messages": messages, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"Go on ({turn})."}]
    return cached


async def _workers(probe: httpx.AsyncClient) -> list[dict]:
    """The workers the router at `probe` lists; none while it does not answer."""
    try:
        return (await probe.get("/workers")).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []


async def _registered(router: trio.Process, probe: httpx.AsyncClient,
                      seen: list[tuple[float, list[dict]]]) -> list[dict] | None:
    """The router's workers once both replicas are registered and healthy, under the name their
    /server_info gives; None if the router exited first (a port taken: try again) or took 30 s.
    `seen` gets each answer that differs from the one before (for the failure's message)."""
    with trio.move_on_after(30):
        while router.returncode is None:
            ws = await _workers(probe)
            if not seen or seen[-1][1] != ws:
                seen.append((round(trio.current_time(), 1), ws))
            if len(ws) == 2 and all(w["is_healthy"] and w["model_id"] == "model" for w in ws):
                return ws
            await trio.sleep(0.2)
    return None


@pytest.mark.skipif(ROUTER is None, reason="sglang-router is not installed (the test extra has it)")
async def test_conversations_stick_to_their_replica_and_survive_one_replica_killed(tiny_model_fp32: Path,
                                                                                   tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        replicas = [await start(nursery, [*SERVE, str(tiny_model_fp32), "--port", "0", "--no-warmup",
                                          "--replica", name, "--max-batch", "8"]) for name in ("r1", "r2")]
        router: trio.Process | None = None
        try:
            with trio.fail_after(60):
                for p in replicas:
                    await p.has_url.wait()
            failures: list[str] = []
            for attempt in range(3):
                # A port picked free can be taken before the router binds it (it exits then): each
                # start that did not register both replicas within 30 s is retried on fresh ports,
                # and reported as a warning (the suite's summary shows it) with what the router's
                # /workers said and its log. (Its gRPC probe of each replica, a body a moment after
                # the headers, also stopped the replicas now and then, before
                # server/_connections.py kept one connection's failure to that connection.)
                log = tmp_path / f"router-{attempt}.log"
                router_port = _free_port()
                with log.open("wb") as out:
                    router = await trio.lowlevel.open_process(
                        [str(ROUTER), "launch", "--host", "127.0.0.1", "--port", str(router_port),
                         "--worker-urls", *[p.url or "" for p in replicas], "--policy", "cache_aware",
                         "--health-check-endpoint", "/ready", "--health-check-interval-secs", "1",
                         "--health-failure-threshold", "2", "--prometheus-host", "127.0.0.1",
                         "--prometheus-port", str(_free_port()), "--log-level", "warn"],
                        stdout=out, stderr=out, env=ENV, start_new_session=True)
                url = f"http://127.0.0.1:{router_port}"
                seen: list[tuple[float, list[dict]]] = []
                async with httpx.AsyncClient(base_url=url, timeout=5) as probe:
                    ws = await _registered(router, probe, seen)
                if ws is not None:
                    break
                exited = router.returncode is not None
                if not exited:
                    os.killpg(router.pid, signal.SIGKILL)
                code = await router.wait()
                router = None
                failures.append(f"attempt {attempt}: {'exited ' + str(code) if exited else 'running after 30 s'}; "
                                f"/workers said {seen}; its log: {log.read_text()[-2000:]}")
            else:
                pytest.fail(f"the router never registered both replicas: {failures}; "
                            f"the replicas' logs: {[p.text[-1500:] for p in replicas]}")
            if failures:
                warnings.warn(f"the router registered both replicas only at attempt {len(failures)}: {failures}",
                              stacklevel=1)
            async with httpx.AsyncClient(base_url=url, timeout=5) as probe:
                assert [m["id"] for m in (await probe.get("/v1/models")).json()["data"]] == ["model"]

                def traffic() -> None:
                    with httpx.Client(base_url=url, timeout=60) as client:
                        with concurrent.futures.ThreadPoolExecutor(4) as pool:
                            for cached in pool.map(lambda n: _conversation(client, n), range(4)):
                                # the prefix held (the replicas' logs: which one served what)
                                assert cached[0] < 40 and all(c > 300 for c in cached[1:]), (
                                    cached, [p.text[-2000:] for p in replicas])
                        # greedy: a sampled answer of the random model may end at its first token
                        with client.stream("POST", CHAT, json={"model": "model", "max_tokens": 4, "stream": True,
                                                               "temperature": 0,
                                                               "stream_options": {"include_usage": True},
                                                               "messages": [{"role": "user", "content": "Hi"}]}) as r:
                            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 4
                        # The router fills in store: true when the client leaves it out: this server keeps none.
                        r = client.post("/v1/responses", json={"model": "model", "input": "Hi", "max_output_tokens": 4,
                                                               "store": False, "temperature": 0})
                        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 4, r.text

                await trio.to_thread.run_sync(traffic)
                busiest = max(replicas, key=_served)
                other = replicas[1 - replicas.index(busiest)]
                before = _served(other)
                busiest.proc.send_signal(signal.SIGKILL)
                with trio.fail_after(15):  # the router's health check notices (twice, a second apart)
                    while any(w["is_healthy"] for w in await _workers(probe) if w["url"] == busiest.url):  # noqa: ASYNC110
                        await trio.sleep(0.2)

                def after() -> list[list[int]]:
                    with httpx.Client(base_url=url, timeout=60) as client:
                        return [_conversation(client, n, turns=2) for n in range(4)]

                for cached in await trio.to_thread.run_sync(after):  # not one lost
                    assert cached[1] > 300, cached  # and the survivor builds the prefixes up again
                with trio.fail_after(5):  # its access log reaches us a moment after the answers
                    while _served(other) < before + 8:  # noqa: ASYNC110 - another process's log
                        await trio.sleep(0.05)
                assert _served(other) == before + 8
        finally:
            if router is not None:
                os.killpg(router.pid, signal.SIGKILL)
                with trio.move_on_after(10):
                    await router.wait()
            nursery.cancel_scope.cancel()  # kills the replicas (`processes.start`)
