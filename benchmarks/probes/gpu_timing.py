"""Shared by the GPU probes run as scripts (probe_new_shapes.py, probe_contiguous_kv.py,
probe_step_python.py, probe_followup.py): the model under test, and timers that wait for the
device on both sides of the call."""
import time

import mlx.core as mx

from trio_mlx.models import load_model


def load(path: str):
    """(model, layers, vocabulary size) of the model directory at `path`."""
    model, config = load_model(path)
    return model, int(config["num_hidden_layers"]), int(config["vocab_size"])


def timed(fn) -> float:
    """Milliseconds to build and evaluate `fn()`'s result, the device idle before and after."""
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def steps_to_first_token(bg, uid: int) -> list[float]:
    """Milliseconds of each `bg.next()` (a BatchGenerator's) until row `uid`'s first token
    is out, the device idle before and after each."""
    steps = []
    while True:
        mx.synchronize()
        t0 = time.perf_counter()
        _, gen = bg.next()
        mx.synchronize()
        steps.append(1e3 * (time.perf_counter() - t0))
        if any(r.uid == uid for r in gen):
            return steps
