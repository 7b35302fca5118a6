"""probe_grammar_engine.py (the array schema) with the budget's bookkeeping counted: what each token
that left the completion was taken to add (a margin's worth or `_far`'s), the masks' verdicts on
calm tokens (`_settle`), the measurements, and the calls and time of the checks they make.

    PYTHONPATH=. SHARES=1 GRAMMAR_MASKS=auto python3 count.py MODEL ROWS TOKENS

Prints the probe's lines, then the first few tokens taken as adding `_far` (with the
completion's first tokens then) and `COUNTS {...}`.
"""

from __future__ import annotations

import atexit
import collections
import pathlib
import runpy
import sys
import time
from typing import Any

from trio_mlx.actor import _constrain

C: collections.Counter[str] = collections.Counter()
G = _constrain.GrammarProcessor
grow, settle, measure = G._grow, G._settle, G._measure
SHOWN = 20


def _text(g: Any, ids: list[int]) -> list[str]:
    return [g._vocab.tokenizer.decode_str([t]) for t in ids]


def counted_grow(self: Any, token: int, settled: bool = True) -> None:
    before = self._extra
    grow(self, token, settled)
    if before >= 0:
        far = self._extra - before != _constrain.BUDGET_MARGIN
        C["far" if far else "margin"] += 1
        if far and C["shown"] < SHOWN:
            C["shown"] += 1
            print("FAR", repr(_text(self, [token])[0]), _text(self, self._tail[:4]), flush=True)


def counted_settle(self: Any) -> None:
    before, token = self._extra, self._pending
    settle(self)
    if token is not None:
        C["settle_far" if self._extra != before else "settle_margin"] += 1
        if self._extra != before and C["shown"] < SHOWN:
            C["shown"] += 1
            print("SETTLE FAR", repr(_text(self, [token])[0]), _text(self, self._tail[:4]), flush=True)


def counted_measure(self: Any, m: Any, left: int) -> None:
    C["measure"] += 1
    measure(self, m, left)
    C["endgame after" if self._endgame else "free after"] += 1


G._grow, G._settle, G._measure = counted_grow, counted_settle, counted_measure  # type: ignore[method-assign]
for name in ("finish", "resumes", "completes"):
    fn = getattr(_constrain, name)

    def timed(*a: Any, _fn: Any = fn, _name: str = name, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return _fn(*a, **k)
        finally:
            us = int(1e6 * (time.perf_counter() - t))
            C[_name] += 1
            C[_name + " us"] += us
            C[_name + " max us"] = max(C[_name + " max us"], us)

    setattr(_constrain, name, timed)
atexit.register(lambda: print("COUNTS", dict(C), flush=True))
probe = pathlib.Path(__file__).resolve().parents[2] / "probes" / "probe_grammar_engine.py"
sys.argv = [str(probe), sys.argv[1], sys.argv[2], sys.argv[3], "1", "array"]
runpy.run_path(str(probe), run_name="__main__")
