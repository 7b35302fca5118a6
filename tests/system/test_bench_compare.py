"""`trio-mlx bench compare`: servers started, loaded and stopped in turn, in rounds of alternating
order, their figures side by side. The servers are tests/fake_sse_server.py (standard library
only, a fraction of a second to start), each in a process of its own as a real server would
be; the bench runs against them for real. The plan alone: tests/unit/test_bench_compare.py."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from trio_mlx.bench import _cli as _bench

FAKE = shlex.join([sys.executable, str(Path(__file__).parent.parent / "fake_sse_server.py")])


def test_each_side_serves_its_runs_and_the_summary_sets_them_side_by_side(tiny_model_fp32: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "ab"
    rc = _bench.main([
        "compare", "--out", str(out), "--rounds", "2",
        "--side", f"fast={FAKE} --port {{port}} --tag {{run}}",
        # 3 ms between tokens; no /ready (as mlx_lm.server): ready by /health
        "--side", f"slow=FAKE_DELAY=0.003 {FAKE} --port {{port}} --tag {{run}} --no-ready",
        "--", "--model", str(tiny_model_fp32), "--concurrency", "1,2", "--requests-per-level", "4",
        "--prompt-tokens", "16", "--max-tokens", "5", "--warmup", "0", "--quiet",
    ])
    assert rc == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "fast-1.json", "fast-1.log", "fast-2.json", "fast-2.log",
        "slow-1.json", "slow-1.log", "slow-2.json", "slow-2.log", "summary.md"]
    # each run's server got its port, its run's name and its side's environment
    for run, delay in (("fast-1", 0.0), ("fast-2", 0.0), ("slow-1", 0.003), ("slow-2", 0.003)):
        assert (out / f"{run}.log").read_text().startswith(f"fake server {run} on "), run
        assert f"FAKE_DELAY={delay}" in (out / f"{run}.log").read_text()
    results = {run: json.loads((out / f"{run}.json").read_text()) for run in ("fast-1", "fast-2", "slow-1", "slow-2")}
    for run, res in results.items():
        assert res["label"] == run and res["target"].startswith("http://127.0.0.1:")
        assert [lv["concurrency"] for lv in res["levels"]] == [1, 2]
        assert all(lv["completed"] == 4 and lv["output_tokens"] == 20 for lv in res["levels"])
        assert all(lv.get("server_cpu_us_per_token") is not None for lv in res["levels"])  # its pid, given
    for lv in results["slow-1"]["levels"] + results["slow-2"]["levels"]:
        assert lv["tpot_ms"]["p50"] >= 3.0  # the side's own pace
    text = (out / "summary.md").read_text()
    assert text == capsys.readouterr().out
    assert text.startswith("# fast / slow: 2 round(s), in the order fast-1, slow-1, slow-2, fast-2\n")
    assert len([line for line in text.splitlines() if line.startswith("| c=1 |")]) == 3  # tok/s, latency, CPU

    def tps(run: str) -> float:  # at c=2
        return results[run]["levels"][1]["output_throughput"]

    ratio = (tps("slow-1") + tps("slow-2")) / (tps("fast-1") + tps("fast-2"))
    first = next(line for line in text.splitlines() if line.startswith("| c=2 |"))  # the tok/s table's
    assert first == (f"| c=2 | {tps('fast-1'):,.0f} / {tps('fast-2'):,.0f} | "
                     f"{tps('slow-1'):,.0f} / {tps('slow-2'):,.0f} (x{ratio:.2f}) |")


def test_chat_runs_side_args_and_a_server_that_never_gets_ready(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "chat"
    never = shlex.join([sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"])
    rc = _bench.main([
        "compare", "--out", str(out), "--rounds", "1",
        "--side", f"on={FAKE} --port {{port}}", "--side", f"off={FAKE} --port {{port}}",
        "--side", f"broken={never}", "--side-args", "off=--seed 7",
        "--", "chat", "--conversations", "1,2", "--turns", "2", "--system-words", "10", "--user-words", "5",
        "--max-tokens", "4", "--warmup", "0", "--quiet",
    ])
    assert rc == 1  # a side failed
    on, off = (json.loads((out / f"{run}.json").read_text()) for run in ("on-1", "off-1"))
    assert on["settings"]["seed"] == 0 and off["settings"]["seed"] == 7  # its --side-args, its alone
    assert [lv["conversations"] for lv in on["levels"]] == [1, 2]
    assert not (out / "broken-1.json").exists()
    assert (out / "broken-1.log").read_text() == "no model here\n"
    text = (out / "summary.md").read_text()
    lv = on["levels"][1]
    turns = f"{lv['turns'][-2]['ttft_ms']['p50']:,.0f} / {lv['turns'][-1]['ttft_ms']['p50']:,.0f}"
    assert f"| conversations=2 | {turns} |" in text  # the last turn's TTFT p50 / the fresh requests'
    assert text.rstrip().endswith("- broken-1: not ready (exit status 3; see broken-1.log)")
    assert "| conversations=1 |" in text and " | - |" in text  # the broken side's cells
