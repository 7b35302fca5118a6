"""GET /metrics: Prometheus text from per-request records and from engine statistics at scrape time."""

from __future__ import annotations

import time

import prometheus_client
from app_server import (
    CHAT,
    COMPLETIONS,
    chat_body,
    engine_factory,
    open_raw,
    scrape,
    serve,
    slow_steps,
    until,
)

from trio_mlx import Engine
from trio_mlx.server._request_trace import RequestTrace


async def test_requests_tokens_latencies_and_engine_gauges(tiny_model_fp32):
    async with serve(tiny_model_fp32) as server, server.client() as client:
        usages = []
        for _ in range(2):
            r = await client.post(CHAT, json=chat_body(max_tokens=5, ignore_eos=True))
            usages.append(r.json()["usage"])
        async with client.stream("POST", COMPLETIONS, json={"prompt": [5, 6, 7, 8], "max_tokens": 7,
                                                            "ignore_eos": True, "stream": True}) as resp:
            assert b"[DONE]" in b"".join([c async for c in resp.aiter_raw()])
        assert (await client.post(CHAT, json={"messages": []})).status_code == 400
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/no/such/path")).status_code == 404
        await until(lambda: not server.app.pump.streams)  # the stream's record is observed
        m = await scrape(client)

    total = "trio_mlx_requests_total"
    assert m.value(total, endpoint=CHAT, status="200") == 2
    assert m.value(total, endpoint=COMPLETIONS, status="200") == 1
    assert m.value(total, endpoint=CHAT, status="400") == 1
    assert m.value(total, endpoint="/health", status="200") == 1
    assert m.value(total, endpoint="unmatched", status="404") == 1
    assert m.value("trio_mlx_request_outcomes_total", endpoint=CHAT, outcome="ok") == 2
    assert m.value("trio_mlx_request_outcomes_total", endpoint=CHAT, outcome="error") == 1
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert m.value(f"trio_mlx_{name}_count", endpoint=CHAT) == 2, name
        assert m.value(f"trio_mlx_{name}_count", endpoint=COMPLETIONS) == 1, name
        assert m.value(f"trio_mlx_{name}_sum", endpoint=CHAT) > 0, name
        assert m.value(f"trio_mlx_{name}_bucket", endpoint=CHAT, le="+Inf") == 2, name
    assert m.value("trio_mlx_completion_tokens_total", endpoint=CHAT) == 10
    assert m.value("trio_mlx_completion_tokens_total", endpoint=COMPLETIONS) == 7
    assert m.value("trio_mlx_prompt_tokens_total", endpoint=CHAT) == sum(u["prompt_tokens"] for u in usages)
    assert m.value("trio_mlx_prompt_tokens_total", endpoint=COMPLETIONS) == 4
    # read from engine.statistics() at scrape time
    assert m.value("trio_mlx_engine_requests_submitted_total") == 3
    assert m.value("trio_mlx_engine_generated_tokens_total") == 17
    assert m.value("trio_mlx_engine_state", state="ready") == 1
    assert m.value("trio_mlx_engine_state", state="broken") == 0
    assert m.value("trio_mlx_queue_depth") == m.value("trio_mlx_active_sequences") == 0
    assert m.value("trio_mlx_requests_in_engine", stage="decode") == 0
    assert m.value("trio_mlx_decode_steps_total") >= 7
    assert m.value("trio_mlx_decode_step_seconds_total") > 0
    assert m.value("trio_mlx_mlx_active_memory_bytes") > 0
    assert m.value("trio_mlx_mlx_peak_memory_bytes") >= m.value("trio_mlx_mlx_active_memory_bytes")
    assert "trio_mlx_mlx_cache_memory_bytes" in m.samples  # read when the batch emptied: current when idle
    assert m.value("trio_mlx_aborts_by_cause_total", cause="stall") == 0  # exists before any abort
    assert m.value("process_resident_memory_bytes") > 0


async def test_aborts_by_stage_and_cause_and_two_apps_keep_their_own_registry(tiny_model_fp32):
    # (One trio run serves one engine at a time, so a and b are served one after the other.)
    factory = engine_factory(fault_hook=slow_steps(0.005))
    async with serve(tiny_model_fp32, factory=factory) as a, a.client() as ca:
        engine = a.engine
        sock = await open_raw(a.port, CHAT, chat_body(max_tokens=900, stream=True, ignore_eos=True))
        await until(lambda: engine.statistics().decoding == 1)
        during = await scrape(ca)
        sock.close()
        await until(lambda: engine.statistics().active == 0 and not a.app.pump.streams)
        ma = await scrape(ca)
    async with serve(tiny_model_fp32) as b, b.client() as cb:
        assert (await cb.post(CHAT, json=chat_body(max_tokens=2))).status_code == 200
        mb = await scrape(cb)
    assert during.value("trio_mlx_requests_in_engine", stage="decode") == 1
    assert during.value("trio_mlx_open_streams") == 1
    assert during.value("trio_mlx_seconds_since_step") < 5
    assert ma.value("trio_mlx_aborts_by_stage_total", stage="decode") == 1
    assert ma.value("trio_mlx_aborts_by_cause_total", cause="disconnect") == 1
    assert ma.value("trio_mlx_request_outcomes_total", endpoint=CHAT, outcome="disconnect") == 1
    assert ma.value("trio_mlx_requests_total", endpoint=CHAT, status="200") == 1  # the stream had started
    assert ma.value("trio_mlx_e2e_request_latency_seconds_count", endpoint=CHAT) == 0  # not completed
    assert ma.value("trio_mlx_open_streams") == ma.value("trio_mlx_active_sequences") == 0
    # b saw none of a's traffic, and a none of b's
    assert mb.value("trio_mlx_aborts_by_cause_total", cause="disconnect") == 0
    assert mb.value("trio_mlx_request_outcomes_total", endpoint=CHAT, outcome="ok") == 1
    assert ma.value("trio_mlx_request_outcomes_total", endpoint=CHAT, outcome="ok") == 0
    # and neither touched prometheus_client's global registry
    assert prometheus_client.REGISTRY.get_sample_value("trio_mlx_requests_total",
                                                        {"endpoint": CHAT, "status": "200"}) is None


async def test_metrics_cost_nothing_per_token(tiny_model_fp32, monkeypatch):
    """A 300-token stream makes as many metric updates as a 3-token one: one set per request."""
    calls = {"n": 0}
    for cls, method in ((prometheus_client.Histogram, "observe"), (prometheus_client.Counter, "inc"),
                        (Engine, "statistics")):
        original = getattr(cls, method)

        def counted(self, *args, _original=original, **kwargs):
            calls["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, method, counted)

    async def updates_for(client, tokens: int) -> int:
        before = calls["n"]
        body = {"prompt": "x", "max_tokens": tokens, "ignore_eos": True, "stream": True}
        async with client.stream("POST", COMPLETIONS, json=body) as resp:
            raw = b"".join([c async for c in resp.aiter_raw()])
        assert raw.endswith(b"data: [DONE]\n\n")
        await until(lambda: not server.app.pump.streams)  # the pump observes, then leaves
        return calls["n"] - before

    async with serve(tiny_model_fp32, max_event_rate=0) as server, server.client() as client:
        short = await updates_for(client, 3)
        long = await updates_for(client, 300)
    assert 0 < short == long <= 12, (short, long)


async def test_metrics_answer_while_the_model_loads(tiny_model_fp32):
    """Before the engine exists the collector reports state "starting" and zeros."""
    from trio_mlx.server._app import create_app
    from trio_mlx.server._settings import Settings

    app = create_app(Settings(model=str(tiny_model_fp32)))
    body, content_type = app.metrics.render()
    text = body.decode()
    assert content_type.startswith("text/plain; version=0.0.4")
    assert 'trio_mlx_engine_state{state="starting"} 1.0' in text
    assert "trio_mlx_queue_depth 0.0" in text
    body, content_type = app.metrics.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")


async def test_the_request_trace_lines_requests_up_with_the_step_trace(tiny_model_fp32, tmp_path):
    """--step-trace FILE: the server writes FILE.requests, one line per completion request,
    on the step trace's clock (arrival), with its intake, first token and end after it,
    and its prompt, cached and completion tokens as its usage said."""
    steps = tmp_path / "steps.tsv"
    prompt = [(i * 7) % 400 + 3 for i in range(300)]
    t0 = time.perf_counter()
    async with serve(tiny_model_fp32, step_trace=str(steps)) as server, server.client() as client:
        usages = []
        for _ in range(2):  # the second finds the first's prompt in the prompt cache
            r = await client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True})
            usages.append(r.json()["usage"])
        async with client.stream("POST", CHAT, json=chat_body(max_tokens=3, ignore_eos=True, stream=True)) as resp:
            assert b"[DONE]" in b"".join([c async for c in resp.aiter_raw()])
        await until(lambda: not server.app.pump.streams)  # the stream's record is observed
    t1 = time.perf_counter()
    header, *lines = (tmp_path / "steps.tsv.requests").read_text().splitlines()
    assert header == RequestTrace.HEADER.rstrip("\n")
    rows = [dict(zip(header.split("\t"), line.split("\t"), strict=True)) for line in lines]
    assert [r["endpoint"] for r in rows] == [COMPLETIONS, COMPLETIONS, CHAT]
    for r in rows:
        assert t0 < float(r["arrived"]) < t1
        assert 0 < float(r["intake_s"]) <= float(r["ttft_s"]) <= float(r["e2e_s"])
        assert r["outcome"] == "ok" and r["request_id"].startswith(("cmpl-", "chatcmpl-"))
    for r, usage in zip(rows, usages, strict=False):
        assert int(r["prompt_tokens"]) == usage["prompt_tokens"] == len(prompt)
        assert int(r["cached_tokens"]) == usage["prompt_tokens_details"]["cached_tokens"]
        assert int(r["completion_tokens"]) == 4
    assert int(rows[1]["cached_tokens"]) > 0 and int(rows[2]["completion_tokens"]) == 3
    # one clock: the step that took the first request in came after its arrival and before its end
    step_rows = [line.split("\t") for line in steps.read_text().splitlines()[1:]]
    first_in = next(float(s[0]) for s in step_rows if int(s[3]) > 0)
    arrived = float(rows[0]["arrived"])
    assert arrived < first_in < arrived + float(rows[0]["e2e_s"])
