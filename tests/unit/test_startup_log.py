"""What a server says while it starts: each stage with its duration, conversion progress,
and the settings one per line (not a raw dict).

Here what needs no model; a start and a conversion: tests/integration/test_startup_log.py.
"""

from __future__ import annotations

import logging
import re

from trio_mlx.models import _models
from trio_mlx.server._serve import describe_settings
from trio_mlx.server._settings import Settings


def messages(caplog, prefix: str = "trio_mlx") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith(prefix)]


def test_a_quick_conversion_step_logs_no_progress(caplog):
    caplog.set_level(logging.INFO, logger="trio_mlx.models")
    progress = _models._Progress("converting the weights", 3, "tensors")
    for _ in range(3):
        progress.advance()
    progress.note("writing the tokenizer")
    assert messages(caplog, "trio_mlx.models") == []


def test_settings_are_logged_one_per_line_with_changes_marked():
    text = describe_settings(Settings.from_env({}, max_batch=8, api_key="sekret", cors_origins=("https://a.example",)))
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
