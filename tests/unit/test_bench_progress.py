"""`trio-mlx bench` draws a progress bar per level on a terminal, and nothing elsewhere.

Here the bar itself; a whole run's bars: tests/integration/test_bench_progress.py.
"""

from __future__ import annotations

import io

from trio_mlx.bench._progress import LevelBar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_counts_requests_and_tokens_on_a_terminal() -> None:
    out = Terminal()
    with LevelBar("c=2", 3, out) as bar:
        for _ in range(3):
            bar.done(5)
    text = out.getvalue()
    assert "c=2" in text and "3/3" in text and "15 tokens" in text


def test_no_bar_when_stderr_is_not_a_terminal() -> None:
    out = io.StringIO()
    with LevelBar("c=2", 3, out) as bar:
        bar.done(5)
    assert out.getvalue() == "" and bar.tokens == 0
