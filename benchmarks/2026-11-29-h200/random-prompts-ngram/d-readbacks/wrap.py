# probe wrapper: counts mx.clear_cache calls and prompt lookup's read-backs; NOCLEAR=1 makes clear_cache a no-op
import atexit, os, runpy, sys
import mlx.core as mx
_orig = mx.clear_cache
n = {"clear": 0, "readback": 0}
def _clear():
    n["clear"] += 1
    if os.environ.get("NOCLEAR") != "1":
        _orig()
mx.clear_cache = _clear
from trio_mlx.actor import _speculate
_rep = _speculate.NgramIndex.repeats
def repeats(self, m):
    r = _rep(self, m)
    n["readback"] += bool(r)
    return r
_speculate.NgramIndex.repeats = repeats
atexit.register(lambda: print("COUNTS", n, file=sys.stderr, flush=True))
sys.argv = ["trio_mlx.cli"] + sys.argv[1:]
runpy.run_module("trio_mlx.cli", run_name="__main__")
