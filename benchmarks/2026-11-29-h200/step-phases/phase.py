"""Per-phase timers inside the actor's step (diagnostic wrapper around `python -m trio_mlx.cli`).
PHASE_OUT=FILE: one line per timed call: step, phase, start (s, perf_counter), ms.
Phases: the whole Actor._step, BatchGenerator.next, prefill (prompt batch's prompt), _owned_generate,
_split_rows, GenerationBatch.extend / filter, remove_rows, unmask_unpadded, _owned_step, Decoder.step,
Decoder._plan_for, Decoder._sample, async_eval in _decode, reuse.prefilled / leaving, first_tokens,
_tokens, gc collections (gen)."""
import atexit
import functools
import gc
import importlib
import os
import runpy
import sys
import time

import mlx.core as mx

from trio_mlx.actor import _actor, _batch, _decode, _reuse

G = importlib.import_module("mlx_lm.generate")  # the module: `mlx_lm.generate` is also a function

clock = time.perf_counter
events: list[tuple[int, str, float, float]] = []
state = {"step": 0}


def timed(name, fn):
    @functools.wraps(fn)
    def w(*a, **k):
        t = clock()
        try:
            return fn(*a, **k)
        finally:
            events.append((state["step"], name, t, (clock() - t) * 1e3))
    return w


def patch(obj, attr, name):
    setattr(obj, attr, timed(name, getattr(obj, attr)))


_orig_step = _actor.Actor._step


def step(self, failed):
    state["step"] += 1
    t = clock()
    try:
        return _orig_step(self, failed)
    finally:
        events.append((state["step"], "STEP", t, (clock() - t) * 1e3))


_actor.Actor._step = step
patch(G.BatchGenerator, "next", "bg.next")
for cls_name in ("PromptProcessingBatch",):
    cls = getattr(G, cls_name, None)
    if cls is not None and hasattr(cls, "prompt"):
        patch(cls, "prompt", "prefill")
patch(G.GenerationBatch, "extend", "gen.extend")
patch(G.GenerationBatch, "filter", "gen.filter")
patch(_batch, "_owned_generate", "owned_generate")
patch(_batch, "_owned_step", "owned_step")
patch(_batch, "_split_rows", "split_rows")
patch(_batch, "unmask_unpadded", "unmask")
patch(_batch, "first_tokens", "first_tokens_b")
patch(_actor, "remove_rows", "remove_rows")
patch(_decode.Decoder, "step", "dec.step")
patch(_decode.Decoder, "_plan_for", "dec.plan")
patch(_decode.Decoder, "_sample", "dec.sample")
patch(_actor.Actor, "_tokens", "actor.tokens")
patch(_actor.Actor, "_first_tokens", "actor.first_tokens")
patch(_actor.Actor, "_apply", "actor.apply")
for meth in ("prefilled", "leaving"):
    for cls in vars(_reuse).values():
        if isinstance(cls, type) and hasattr(cls, meth) and meth in vars(cls):
            patch(cls, meth, f"reuse.{meth}")


class _MxShim:
    def __getattr__(self, name):
        return getattr(mx, name)

    @staticmethod
    def async_eval(*a):
        t = clock()
        mx.async_eval(*a)
        events.append((state["step"], "async_eval", t, (clock() - t) * 1e3))


_decode.mx = _MxShim()

_gc_t = {}


def _gc_cb(phase, info):
    if phase == "start":
        _gc_t["t"] = clock()
    else:
        t = _gc_t.get("t", clock())
        events.append((state["step"], f"gc{info.get('generation')}", t, (clock() - t) * 1e3))


gc.callbacks.append(_gc_cb)


def dump():
    out = os.environ.get("PHASE_OUT")
    if not out:
        return
    with open(out, "w") as f:
        f.write("step\tphase\tt\tms\n")
        for s, n, t, ms in events:
            f.write(f"{s}\t{n}\t{t:.6f}\t{ms:.3f}\n")


atexit.register(dump)
sys.argv = ["trio_mlx.cli", *sys.argv[1:]]
runpy.run_module("trio_mlx.cli", run_name="__main__")
