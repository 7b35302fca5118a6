"""`trio-mlx bench` draws a progress bar per level on a terminal, and nothing elsewhere.

Here a whole run on the tiny model; the bar itself: tests/unit/test_bench_progress.py.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from trio_mlx.bench import _cli as _bench


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_each_level_of_a_run_gets_its_bar(tiny_model_fp32: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    err = Terminal()
    monkeypatch.setattr("sys.stderr", err)
    out = tmp_path / "engine.json"
    argv = ["--engine", "--model", str(tiny_model_fp32), "--concurrency", "1,2", "--requests-per-level", "3",
            "--prompt-tokens", "8", "--max-tokens", "4", "--out", str(out)]
    assert _bench.main(argv) == 0
    assert [lv["completed"] for lv in json.loads(out.read_text())["levels"]] == [3, 3]
    text = err.getvalue()
    for label in ("c=1", "c=2"):
        assert f"{label}: 100%" in text and "3/3" in text, text
    assert "12 tokens" in text
