"""What a server says while it starts: each stage with its duration, conversion progress,
and the settings one per line (not a raw dict).

Here a start and a conversion; what needs no model: tests/unit/test_startup_log.py.
"""

from __future__ import annotations

import logging
import re

import trio_mlx
from trio_mlx.models import _models


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
