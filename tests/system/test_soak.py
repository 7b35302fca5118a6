"""The soak (tests/soak.py), short: a server process, 32 concurrent clients, a third of them hanging
up, a tenth stalling, some sending garbage; afterwards nothing is left behind and nothing leaked."""

from __future__ import annotations

import json

import pytest
import soak


@pytest.mark.timeout(90)
async def test_short_soak(tiny_model_fp32):
    # Leaks are judged twice: MLX's memory in use, idle, is exact and must come back to its warm-up
    # level (within 1 MiB); resident memory is coarse. After only 240 requests the allocators have not
    # settled (runs of this size moved between -3.3% and +5.7%), so RSS is held to 15% here, which
    # still catches ~80 KB kept per request; the long soak's timeline (RELIABILITY.md) holds it to 5%.
    opts = soak.Options(requests=240, warmup=100, concurrency=32, model=str(tiny_model_fp32), seed=7,
                        rss_samples=1, rss_tolerance=0.15, deadline=80)
    report = await soak.run(opts)
    assert report["failures"] == [], json.dumps(report, indent=2, default=str)
    planned, outcomes = report["planned"], report["client_outcomes"]
    total = sum(planned.values())
    assert total == 240 + 100
    # the mix really was a mix, and every client got what its behaviour called for
    assert planned["ok"] == outcomes["completed"] > 0.4 * total
    assert planned["stall"] == outcomes["stall_reaped"] == report["aborts_by_cause"]["stall"] > 0
    fourxx = sum(v for k, v in report["http_statuses"].items() if k.startswith("4"))
    assert planned["invalid"] == outcomes["rejected"] == fourxx > 0  # 400s, and 415 for a text/plain body
    hangups = sum(v for k, v in planned.items() if k.startswith("hangup_"))
    assert outcomes["hung_up"] == hangups > 0.2 * total
    assert 0 < report["aborts_by_cause"]["disconnect"] <= hangups
    stages = report["aborts_by_stage"]
    assert stages["queued"] > 0 and stages["decode"] > 0  # prefill too, mostly: timing decides
    assert report["rss_growth"] <= opts.rss_tolerance
    assert len(report["rss_timeline_bytes"]) == len(report["mlx_active_timeline_bytes"]) == 2
    assert report["mlx_active_timeline_bytes"][1] - report["mlx_active_timeline_bytes"][0] <= opts.mlx_tolerance
    assert report["server_exit_code"] == 0


@pytest.mark.timeout(140)
async def test_short_hostile_soak(tool_model_fp32):
    """The same mix with attacks in it, against a process actor: prompts of megabytes (400 before
    tokenizing), slow bodies (served whole, or 408 when never finished), a SIGKILL of the actor
    mid-soak, and the input attacks: a grammar bomb (400 at the check's 5 s bound), megabytes of
    tool text and of count_tokens (400), millions of token ids (400), n=4 readers that stop
    reading (cut as stalls, every choice), Content-Length with Transfer-Encoding and a request
    pipelined behind (400, closed). Nothing lost but what the kill cut; serving again within the
    restart time; memory back; `/health`, polled every 50 ms throughout, answers 200 with a low p99."""
    # the tiny model with a template that renders tools: tool text is judged by the bound
    opts = soak.Options(requests=160, warmup=40, concurrency=32, model=str(tool_model_fp32), seed=3,
                        rss_samples=1, rss_tolerance=0.15, deadline=120, hostile=True, kill_actor=1)
    report = await soak.run(opts)
    assert report["failures"] == [], json.dumps(report, indent=2, default=str)
    outcomes = report["client_outcomes"]
    assert report["actor_kills"] == report["actor_restarts"] == 1
    assert report["lost_requests"] == 0
    assert len(report["serving_again_after_seconds"]) == 1
    assert report["serving_again_after_seconds"][0] < opts.restart_within
    assert outcomes["huge_rejected"] > 0 and outcomes["slow_body_served"] > 0
    planned = report["planned"]
    for kind in ("grammar_bomb", "tool_text", "count_tokens", "token_ids", "framing"):
        assert planned[kind] == outcomes[f"{kind}_rejected"] > 0, kind  # seed 3 plans each at least once
    assert planned["n_stall"] > 0 and outcomes["n_stall_reaped"] > 0  # the stall aborts: judged in the report
    health = report["health"]
    assert health["statuses"] == {200: health["polls"]} and health["polls"] > 100
    # 2 s allowed (the 2-core box shared with the rest of the suite); measured here: p99 0.06-0.09 s, max 0.17-0.20 s
    assert health["p99_seconds"] < opts.health_p99
    # most ordinary requests complete; the rest were cut by the kill or refused while restarting,
    # which the report's accounting checks (a loaded box cuts more: 60 of 72 once)
    assert outcomes["completed"] > planned["ok"] // 2
    assert report["rss_growth"] <= opts.rss_tolerance
    assert report["mlx_active_timeline_bytes"][1] - report["mlx_active_timeline_bytes"][0] <= opts.mlx_tolerance
    assert report["server_exit_code"] == 0
