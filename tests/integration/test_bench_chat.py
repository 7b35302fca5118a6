"""`trio-mlx bench chat`: multi-turn conversations against a real server, measured per turn.

Here against a server with the tiny model; the conversations' shapes and the plot:
tests/unit/test_bench_chat.py.
"""

from __future__ import annotations

import json

from app_server import serve

from trio_mlx.bench import _chat


async def test_each_turn_resends_the_growing_conversation(tiny_model_fp32, tmp_path):
    args = _chat._parser().parse_args(
        ["--url", "http://unused", "--conversations", "1,3", "--turns", "3", "--system-words", "60",
         "--user-words", "8", "--max-tokens", "4", "--timeout", "60", "--quiet"])
    async with serve(tiny_model_fp32, max_batch=8) as server:
        args.url = server.url
        model, levels = await _chat.run_levels(args)
    assert model and [lv["conversations"] for lv in levels] == [1, 3]
    for lv in levels:
        assert lv["errors"]["total"] == 0
        assert lv["requests"] == lv["conversations"] * (3 + 1)  # the turns and one fresh request
        turns = lv["turns"]
        assert [t["turn"] for t in turns] == [1, 2, 3, "fresh"]
        prompts = [t["prompt_tokens"] for t in turns]
        # each turn carries the last one's prompt, its answer and a new user turn
        assert prompts[0] < prompts[1] < prompts[2] and prompts[3] < prompts[0]
        assert all(t["ttft_ms"]["p50"] > 0 and t["requests"] == lv["conversations"] for t in turns)
        assert lv["output_tokens"] == lv["requests"] * 4
        # every request, in the order each conversation sent them, on the server's clock
        each = lv["by_request"]
        assert len(each) == lv["requests"] and {r["conversation"] for r in each} == set(range(lv["conversations"]))
        for k in range(lv["conversations"]):
            mine = [r for r in each if r["conversation"] == k]
            assert [r["turn"] for r in mine] == [1, 2, 3, "fresh"]
            for a, b in zip(mine, mine[1:], strict=False):
                assert a["sent"] + a["e2e_s"] <= b["sent"]  # a client sends its next turn after the last ends
            assert all(0 < r["ttft_s"] <= r["e2e_s"] and r["error"] is None for r in mine)
    out = tmp_path / "chat.json"
    out.write_text(json.dumps({"levels": levels}))
    assert "| fresh |" in _chat.format_level(levels[0])


STEP = 32


async def test_a_follow_up_turn_reports_the_cached_history_and_the_cache_off_reports_none(tiny_model_fp32):
    args = _chat._parser().parse_args(
        ["--url", "http://unused", "--conversations", "2", "--turns", "3", "--system-words", "40",
         "--user-words", "8", "--max-tokens", "4", "--timeout", "60", "--warmup", "1", "--quiet"])
    results = {}
    for gb in (None, 0.0):
        async with serve(tiny_model_fp32, max_batch=8, prompt_cache_gb=gb, prefill_step=STEP) as server:
            args.url = server.url
            _, (lv,) = await _chat.run_levels(args)
            results[gb] = lv
            assert server.engine.statistics().requests_submitted == 2 * 4 + 1  # the warm-up too
    on, off = results[None]["turns"], results[0.0]["turns"]
    assert all(t["cached_tokens"] == 0 for t in off)
    # every follow-up turn finds the last turn's prompt (its system prompt and history), but for
    # what evening out a group's hits takes off: the two conversations' turns drift apart, and
    # `Reuse.even` cuts a hit at most one prefill step (STEP) back to the group's shortest
    for prev, turn in zip(on[:2], on[1:3], strict=True):
        assert turn["cached_tokens"] >= prev["prompt_tokens"] - STEP
    assert results[None]["last_vs_fresh"] is not None and results[None]["errors"]["total"] == 0
    assert "last turn / fresh TTFT" in _chat.format_level(results[None])
