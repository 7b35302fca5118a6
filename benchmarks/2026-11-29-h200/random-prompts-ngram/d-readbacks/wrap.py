"""`trio-mlx bench`, counting prompt lookup's read-backs (where `NgramIndex.repeats` said yes, the
read-back's condition) and `mx.clear_cache` calls, printed as one `COUNTS` line on stderr at exit;
with NOCLEAR=1, `mx.clear_cache` does nothing. `python wrap.py bench ARGS...` (run.sh)."""

import atexit
import os
import runpy
import sys

import mlx.core as mx

from trio_mlx.actor import _speculate

_clear_cache = mx.clear_cache
_repeats = _speculate.NgramIndex.repeats
counts = {"clear": 0, "readback": 0}


def clear_cache() -> None:
    counts["clear"] += 1
    if os.environ.get("NOCLEAR") != "1":
        _clear_cache()


def repeats(self: _speculate.NgramIndex, m: int) -> bool:
    said = _repeats(self, m)
    counts["readback"] += bool(said)
    return said


mx.clear_cache = clear_cache
_speculate.NgramIndex.repeats = repeats  # type: ignore[method-assign]
atexit.register(lambda: print("COUNTS", counts, file=sys.stderr, flush=True))
sys.argv = ["trio_mlx.cli", *sys.argv[1:]]
runpy.run_module("trio_mlx.cli", run_name="__main__")
