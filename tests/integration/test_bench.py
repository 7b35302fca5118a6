"""`trio-mlx bench`: statistics, SSE and HTTP parsing, prompts, the --limit ceiling, plots and
tables, and the HTTP mode against real servers on 127.0.0.1 (a fake SSE server in-process, and
mlx_lm.server in a subprocess).

Here the --limit, --engine and --url modes on the tiny model, in process; the rest:
tests/unit/test_bench.py and tests/system/test_bench.py.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import trio

from trio_mlx import _heap
from trio_mlx.bench import _cli as _bench
from trio_mlx.bench._prompts import model_from_server


@pytest.fixture(scope="module")
def tiny_model(tiny_model_fp32: Path) -> Path:
    return tiny_model_fp32


# -------------------------------------------------------------- --limit mode


def test_limit_mode_on_the_tiny_model(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out, trace = tmp_path / "limit.json", tmp_path / "ceiling.tsv"
    monkeypatch.setenv("TRIO_MLX_CEILING_TRACE", str(trace))
    monkeypatch.setattr(_heap, "enabled", True)  # the suite turns it off (conftest.py)
    gc.unfreeze()  # whatever an earlier test left frozen
    rc = _bench.main(
        [
            "--limit",
            "--model",
            str(tiny_model),
            "--concurrency",
            "1,4",
            "--requests-per-level",
            "6",
            "--prompt-tokens",
            "24",
            "--max-tokens",
            "8",
            "--label",
            "ceiling",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    # the client froze its tokenizer and prompts out of Python's collector before measuring
    # (trio_mlx/_heap.py: its full collections would land in the figures)
    assert gc.get_freeze_count() > 0
    res = json.loads(out.read_text())
    assert res["target"] == "limit" and res["settings"]["completion_batch_size"] == 4
    assert res["command"][:3] == ["trio-mlx", "bench", "--limit"]
    assert "mlx" in res["device"]
    assert res["settings"]["ceilings"] == ["batchgenerator", "bare"]  # both, level by level
    assert [(lv["concurrency"], lv["ceiling"]) for lv in res["levels"]] == [
        (1, "batchgenerator"), (1, "bare"), (4, "batchgenerator"), (4, "bare")]
    # the bare forward: one wave of c rows of the level's prompts, each making max_tokens
    for lv in (lv for lv in res["levels"] if lv["ceiling"] == "bare"):
        c = lv["concurrency"]
        assert lv["rows"] == lv["requests"] == lv["completed"] == c and lv["errors"]["total"] == 0
        assert lv["output_tokens"] == c * 8 and lv["itl_ms"]["n"] == c * 7
        assert lv["output_throughput"] > 0 and lv["decode_tok_s"] > 0 and lv["ms_per_step"] > 0
        assert lv["decode_tok_s"] == pytest.approx(c * 1e3 / lv["ms_per_step"])
        assert lv["tpot_ms"]["p50"] == pytest.approx(lv["ms_per_step"])  # a row's TPOT is the step
    # the model's bytes, from the loaded model: no bandwidth on a CPU nobody named
    phys = res["physical"]
    assert phys["source"] == "loaded model" and phys["weight_bytes"] > 0 and phys["kv_bytes_per_token"] > 0
    assert phys["bandwidth_gbs"] is None and phys["device_name"]
    for lv in (lv for lv in res["levels"] if lv["ceiling"] == "batchgenerator"):
        assert lv["requests"] == lv["completed"] == 6 and lv["errors"]["total"] == 0
        assert lv["output_tokens"] == 6 * 8
        assert lv["itl_ms"]["n"] == 6 * 7
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            s = lv[key]
            assert 0 < s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"], (key, s)
        assert lv["ttft_ms"]["p50"] < lv["e2e_ms"]["p50"]
        assert lv["output_throughput"] > 0 and lv["request_throughput"] > 0
    # the step trace has the server actor's columns and adds up to the measured levels
    from trio_mlx.actor._trace import StepTrace as _StepTrace

    lines = trace.read_text().splitlines()
    assert lines[0] + "\n" == _StepTrace.HEADER
    cols = lines[0].split("\t")
    rows = [dict(zip(cols, map(float, line.split("\t")), strict=True)) for line in lines[1:]]
    assert sum(r["generated"] for r in rows) == 2 * 6 * 8
    assert sum(r["inserted"] for r in rows) == 2 * 6
    assert sum(r["prompt_tokens"] for r in rows) > 0 and max(r["rows"] for r in rows) == 4
    assert min(r["cpu_s"] for r in rows) >= 0 and sum(r["cpu_s"] for r in rows) > 0  # the stepping thread's


def test_engine_mode_runs_the_same_prompts_through_the_channel_api(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    argv = ["--model", str(tiny_model), "--concurrency", "1,4", "--requests-per-level", "6",
            "--prompt-tokens", "24", "--max-tokens", "8", "--out", str(out), "--quiet"]  # fmt: skip
    assert _bench.main(["--engine", *argv]) == 0
    res = json.loads(out.read_text())
    assert res["target"] == "engine" and res["settings"]["max_batch"] == 4
    assert "partial" not in res  # per-level checkpoints are marked partial; the final write is not
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 4]
    for lv in res["levels"]:
        assert lv["requests"] == lv["completed"] == 6 and lv["errors"]["total"] == 0
        assert lv["output_tokens"] == 6 * 8
        assert 0 < lv["ttft_ms"]["p50"] < lv["e2e_ms"]["p50"]
        assert lv["event_loop_cpu_us_per_token"] > 0


def test_engine_mode_asks_each_request_for_its_drawn_length(tiny_model: Path, tmp_path: Path) -> None:
    from trio_mlx.bench._prompts import request_lengths

    out = tmp_path / "engine.json"
    argv = ["--engine", "--model", str(tiny_model), "--concurrency", "3", "--requests-per-level", "6",
            "--prompt-tokens", "24", "--max-tokens", "8", "--max-tokens-spread", "0.5", "--out", str(out),
            "--quiet"]  # fmt: skip
    assert _bench.main(argv) == 0
    res = json.loads(out.read_text())
    (lv,) = res["levels"]
    lengths = request_lengths(6, 8, 0.5)
    assert res["max_tokens_spread"] == 0.5 and len(set(lengths)) > 1
    assert lv["errors"]["total"] == 0 and lv["output_tokens"] == sum(lengths)


async def test_url_mode_takes_the_model_from_the_server(tiny_model: Path, tmp_path: Path) -> None:
    from app_server import serve

    async with serve(tiny_model, model_name="tiny-served") as server:
        url = f"http://127.0.0.1:{server.port}"
        ref, served = await trio.to_thread.run_sync(model_from_server, url, 10.0)
        real = str(server.engine.model_path)  # the tiny model's directory, resolved
        assert (ref, served) == (real, "tiny-served")
        out = tmp_path / "run.json"
        argv = ["--url", url, "--concurrency", "1", "--requests-per-level", "2", "--prompt-tokens", "16",
                "--max-tokens", "4", "--warmup", "0", "--quiet", "--out", str(out)]
        assert await trio.to_thread.run_sync(_bench.main, argv) == 0  # no --model
    result = json.loads(out.read_text())
    assert result["served_model_name"] == "tiny-served" and result["model"] == real
    # a server run reads the model's bytes from its safetensors headers, for the table's fraction
    assert result["physical"]["source"] == "safetensors" and result["physical"]["weight_bytes"] > 0
    assert result["levels"][0]["completed"] == 2
    with pytest.raises(SystemExit, match="need --model"):
        _bench.main(["--engine", "--concurrency", "1"])


def test_limit_mode_runs_one_ceiling_alone(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "bare.json"
    argv = ["--limit", "--model", str(tiny_model), "--concurrency", "2", "--requests-per-level", "3",
            "--prompt-tokens", "16", "--max-tokens", "5", "--out", str(out), "--quiet"]  # fmt: skip
    assert _bench.main([*argv, "--ceiling", "bare", "--bandwidth-gbs", "50"]) == 0
    res = json.loads(out.read_text())
    assert [(lv["ceiling"], lv["rows"], lv["output_tokens"]) for lv in res["levels"]] == [("bare", 2, 10)]
    assert res["physical"]["bandwidth_gbs"] == 50 and res["physical"]["bandwidth_source"] == "--bandwidth-gbs"
    assert _bench.main([*argv, "--ceiling", "batchgenerator"]) == 0
    res = json.loads(out.read_text())
    assert [(lv["ceiling"], lv["requests"], lv["output_tokens"]) for lv in json.loads(out.read_text())["levels"]] == [
        ("batchgenerator", 3, 15)]


def test_the_bare_forward_prefills_in_one_forward_with_its_head_at_the_last_position(tiny_model_fp32: Path) -> None:
    """`bare_level`: the prompt and its last token in one forward whose output head is taken at
    the last position (`_shapes.one_position_head`), giving the greedy tokens of a plain
    loop that feeds the last token alone; a model whose head goes by another name keeps
    that way (its whole-prompt graph is dropped unevaluated)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.cache import make_prompt_cache

    from trio_mlx.actor._ceiling import bare_level
    from trio_mlx.models import load_model

    model, _ = load_model(tiny_model_fp32)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]

    def reference(n: int) -> list[list[int]]:
        cache = make_prompt_cache(model)
        x = mx.array(prompts)
        model(x[:, :-1], cache=cache)
        y = mx.argmax(model(x[:, -1:], cache=cache)[:, -1], axis=-1)
        out = [y.tolist()]
        for _ in range(n - 1):
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
            out.append(y.tolist())
        return out

    class Counted(nn.Module):  # the model, its forwards counted by query length
        def __init__(self, inner: nn.Module, own_head: bool = False):
            super().__init__()
            self.inner = inner
            self.lengths: list[int] = []
            self.own_head = own_head

        @property
        def layers(self):
            return self.inner.layers

        def __call__(self, x, cache=None):
            self.lengths.append(x.shape[1])
            if self.own_head:  # the head by another name: every position's logits
                return self.inner.model(x, cache) @ self.inner.model.embed_tokens.weight.T
            return self.inner(x, cache=cache)

    tokens: list = []  # each argmax the bare loop takes: its greedy tokens
    real_argmax = mx.argmax

    def argmax(a, axis=None, **kw):
        out = real_argmax(a, axis=axis, **kw)
        tokens.append(out)
        return out

    for own_head in (False, True):
        counted = Counted(model, own_head)
        tokens.clear()
        mx.argmax = argmax
        try:
            bare_level(counted, prompts, 4)
        finally:
            mx.argmax = real_argmax
        assert [t.tolist() for t in tokens[:4]] == reference(4)
        assert counted.lengths[:2] == ([6, 1] if not own_head else [6, 5])  # one prefill forward, or two


def test_model_bytes_are_its_tensors_and_the_kv_formula(tiny_model: Path) -> None:
    import mlx.core as mx

    from trio_mlx.actor._ceiling import model_bytes
    from trio_mlx.bench._physical import (
        footprint,
        footprint_from_files,
        fraction_of_limit,
        step_bytes,
    )
    from trio_mlx.models import load_model

    tensors = {k: v for f in sorted(tiny_model.glob("*.safetensors")) for k, v in mx.load(str(f)).items()}
    weights = sum(v.nbytes for v in tensors.values())
    cfg = json.loads((tiny_model / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv = cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * 4  # float32
    from_files = footprint_from_files(tiny_model)
    model, config = load_model(tiny_model)
    loaded = footprint(*model_bytes(model), config, "loaded model")
    for fp in (from_files, loaded):
        assert (fp["weight_bytes"], fp["kv_bytes_per_token"], fp["kv_dtype_bytes"]) == (weights, kv, 4)
    # a step of 3 rows at 100 tokens of context reads the weights once and every row's KV
    assert step_bytes(from_files, 3, 100.0) == weights + kv * 100 * 3
    # the fraction: that many bytes at 1 GB/s over the level's TPOT p50 (prompt 96 + output 8 / 2)
    least_ms = (weights + kv * 100 * 3) / 1e9 * 1e3
    level = {"concurrency": 3, "tpot_ms": {"p50": 2 * least_ms}}
    assert fraction_of_limit(level, from_files, 1.0, 96, 8) == pytest.approx(0.5)
    assert fraction_of_limit({"concurrency": None, "rate": 2.0, "tpot_ms": {"p50": 1.0}}, from_files, 1.0, 96, 8) is None


def test_known_bandwidths_by_device_name() -> None:
    from trio_mlx.bench._physical import known_bandwidth

    assert known_bandwidth("NVIDIA H200") == 4800
    assert known_bandwidth("NVIDIA GH200 480GB") == 4000
    assert known_bandwidth("NVIDIA H100 80GB HBM3") == 3350
    assert known_bandwidth("NVIDIA H100 PCIe") == 2000
    assert known_bandwidth("Apple M3 Max") == 400 and known_bandwidth("Apple M2") == 100
    assert known_bandwidth("Intel(R) Xeon(R) Processor") is None and known_bandwidth(None) is None
