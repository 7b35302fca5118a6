"""A progress bar per level of `trio-mlx bench`, on a terminal only.

tqdm draws it on stderr while a level runs (requests done of the level's total,
output tokens so far) and clears it when the level ends, leaving the level's
summary line. When stderr is not a terminal (CI logs, a redirect) there is no bar.
"""

from __future__ import annotations

import sys
from typing import Any


class LevelBar:
    """`done(tokens)` once per finished request; `close()` at the level's end."""

    def __init__(self, label: str, total: int, stream: Any = None):
        stream = sys.stderr if stream is None else stream
        self._bar: Any = None
        self.tokens = 0
        if _is_tty(stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=label, unit="req", file=stream, leave=False,
                             dynamic_ncols=True, mininterval=0.2)

    def done(self, tokens: int) -> None:
        if self._bar is not None:
            self.tokens += tokens
            self._bar.set_postfix_str(f"{self.tokens} tokens", refresh=False)
            self._bar.update(1)
            if self._bar.n >= self._bar.total:
                self._bar.refresh()  # the last request's count, whatever the redraw interval

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> LevelBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def level_label(concurrency: int | None, rate: float | None) -> str:
    return f"c={concurrency}" if concurrency is not None else f"rate={rate}/s"


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
