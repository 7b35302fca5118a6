"""What a server says while it starts: each stage with its duration, conversion progress,
and the settings one per line (not a raw dict)."""

from __future__ import annotations

import logging
import re

import trio_mlx
from trio_mlx.models import _models
from trio_mlx.server._serve import describe_settings
from trio_mlx.server._settings import Settings


def messages(caplog, prefix: str = "trio_mlx") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith(prefix)]


async def test_each_startup_stage_is_logged_with_its_duration(tiny_model_fp32, caplog):
    caplog.set_level(logging.INFO, logger="trio_mlx")
    async with trio_mlx.open_engine(tiny_model_fp32, warmup=True):
        pass
    lines = messages(caplog)
    patterns = [r"resolving the model .*model", r"resolved to .* in \d+\.\d\d s; loading the tokenizer",
                r"tokenizer loaded in \d+\.\d\d s", r"loading the weights on Device\(cpu, 0\)",
                r"loaded llama \(\d+\.\d MB of weights\) in \d+\.\d\d s; decode step: owned",
                r"warming up \(one short prompt\)",
                r"warm-up done in \d+\.\d\d s"]
    found = [next((i for i, line in enumerate(lines) if re.fullmatch(p, line)), None) for p in patterns]
    assert None not in found, (patterns, lines)
    assert found == sorted(found), lines  # in the order they happen


def test_a_conversion_that_takes_a_while_reports_progress(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="trio_mlx.models")
    monkeypatch.setattr(_models._Progress, "QUIET_S", 0.0)  # every step "takes a while"
    monkeypatch.setattr(_models._Progress, "EVERY_S", 0.0)
    _models.ensure_embedded_model(tmp_path)
    lines = messages(caplog, "trio_mlx.models")
    assert lines[0].startswith("converting the embedded default smollm2-135m-instruct (GGUF, ")
    progress = [m for m in lines if m.startswith("converting the weights: ")]
    percents = [int(re.match(r"converting the weights: (\d+)% \((\d+)/(\d+) tensors\)", m)[1]) for m in progress]
    assert len(percents) > 10 and percents == sorted(percents) and percents[-1] == 100
    assert any(m.startswith("writing the tokenizer, ") for m in lines)
    assert re.fullmatch(r"converted in \d+\.\d s", lines[-1])
    caplog.clear()
    _models.ensure_embedded_model(tmp_path)  # converted once: nothing to say the second time
    assert messages(caplog, "trio_mlx.models") == []


def test_a_quick_conversion_step_logs_no_progress(caplog):
    caplog.set_level(logging.INFO, logger="trio_mlx.models")
    progress = _models._Progress("converting the weights", 3, "tensors")
    for _ in range(3):
        progress.advance()
    progress.note("writing the tokenizer")
    assert messages(caplog, "trio_mlx.models") == []


def test_settings_are_logged_one_per_line_with_changes_marked():
    text = describe_settings(Settings(max_batch=8, api_key="sekret", cors_origins=("https://a.example",)))
    lines = text.splitlines()
    assert lines[0].startswith("settings (* set by a flag or a TRIO_MLX_* variable")
    rows = {re.split(r"\s+", line.strip().lstrip("* "))[0]: line for line in lines[1:]}
    assert len(rows) == len(Settings().public())
    assert rows["max-batch"].startswith("  * ") and rows["max-batch"].endswith(" 8")
    assert rows["prefill-batch"].startswith("    ") and rows["prefill-batch"].endswith(" 8")
    assert rows["api-key"].endswith(" ***") and "sekret" not in text
    assert rows["cors-origins"].endswith(" https://a.example")
    assert rows["model"].endswith("(the embedded default)")
    assert rows["model-name"].endswith("- (served as smollm2-135m-instruct)")
    assert "{" not in text


async def test_the_actor_process_logs_its_stages_at_the_servers_level(tiny_model_fp32, caplog, capfd):
    caplog.set_level(logging.INFO, logger="trio_mlx")
    async with trio_mlx.open_engine(tiny_model_fp32, actor="process", warmup=True):
        pass
    err = capfd.readouterr().err  # the child writes to the stderr it inherited
    assert re.search(r"INFO trio_mlx\.actor \(actor process\): loaded llama \(.* MB of weights\) in", err), err
    assert "trio_mlx.actor (actor process): warm-up done in " in err
    caplog.set_level(logging.WARNING, logger="trio_mlx")
    async with trio_mlx.open_engine(tiny_model_fp32, actor="process"):
        pass
    assert "(actor process)" not in capfd.readouterr().err  # quiet when the server is
