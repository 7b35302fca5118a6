"""Probe: log Python's garbage collections in every process that starts with this folder on
PYTHONPATH (Python imports `sitecustomize` at startup).

    PYTHONPATH=benchmarks/probes/gc_log:$PYTHONPATH GC_LOG=/tmp/gc.log <command>

Each process appends to GC_LOG.PID one line per collection of the oldest generation, and per
any collection over 20 ms: perf_counter at its end (the step trace's clock), the generation,
its duration, what it collected, the thread, and (oldest generation only) the objects tracked.
benchmarks/2026-11-28-h200/gc-pauses/ is what it found.
"""
import gc
import os
import threading
import time

_path = os.environ.get("GC_LOG")
if _path:
    _log = open(f"{_path}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115 (open for the process's life)
    _start = [0.0]

    def _collection(phase: str, info: dict) -> None:
        if phase == "start":
            _start[0] = time.perf_counter()
            return
        seconds = time.perf_counter() - _start[0]
        oldest = info["generation"] == 2
        if seconds > 0.02 or oldest:
            objects = len(gc.get_objects()) if oldest else -1
            _log.write(f"{time.perf_counter():.3f}\tgen{info['generation']}\t{seconds * 1e3:.1f}ms\t"
                       f"collected={info['collected']}\t{threading.current_thread().name}\tobjects={objects}\n")

    gc.callbacks.append(_collection)
