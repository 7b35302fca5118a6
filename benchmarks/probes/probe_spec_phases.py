"""Probe: where a speculative step's host time goes, phase by phase, on the edit workload.

    PYTHONPATH=. python benchmarks/probes/probe_spec_phases.py [--model M] [--configs ngram,ngram8]
        [--max-tokens 300] [--repeats 2] [--draft D]

For each configuration (`ngram`: the tuning's defaults; `ngramK`: at most K drafts a step;
`draftK`: the draft model `--draft`, K drafts a step; its drafting split further into the
draft model's forwards' graphs (`draft graph`), their `async_eval`s (`draft async_eval`) and
the fills of a row's history (`draft fill`), all within `propose`; and the same drafts
chained outside the engine, on this thread, a plain thread and `trio.to_thread`),
one engine (the thread actor, in this process) serves `probe_speculative.py`'s edit request
at c=1, `--repeats` times; the first is a warm-up. Every call the speculative step makes
into the actor's helpers is timed by wrappers put on `_spec_step`'s names (the drafter's
`propose` and `settle`, the model's `verify` forward, the decoder's `verify` and `settle`,
`rollback`, and `mx.async_eval`, `mx.concatenate`, `mx.stack`), so that a step splits into:
drafting, building the forward's graph, encoding and starting it (`async_eval`), reading
the inputs back, the per-row sampling graphs, the wait for the device (reading the targets
back: the time from the last sampling graph to the acceptance), the rollback, the rest.
`--draft D --chain-only REPS` runs no engine, only the chained drafts, REPS times: for a
sampling profiler (`py-spy record --native`) to say where their host time goes.
Printed per configuration: the median of each phase over the measured requests' steps,
the steps' median wall time, and from the step trace the plain steps' median, so that
"a speculative step costs N plain ones" can be read off in parts. Nothing is changed in
what the step does; the wrappers cost a few microseconds a call. `NAME cpu`: the actor
thread's CPU time in those calls (`time.thread_time`): short of their wall time, it waited.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import trio_mlx
import trio_mlx.models  # noqa: F401 - first: on MLX's Linux CPU wheel it loads OpenBLAS before mlx.core
from trio_mlx.actor import _drafting, _spec_step

sys.path.insert(0, str(Path(__file__).parent))
from probe_speculative import EDIT, one  # noqa: E402

EVENTS: list[tuple[str, float, float]] = []  # (name, start, end) of every timed call, in order
# Calls whose thread CPU time is taken too (`NAME cpu`, `time.thread_time`): where it falls short
# of the wall time, the thread waited (for the GIL, or in a blocking call), not worked
CPU = ("draft graph", "draft async_eval", "forward", "async_eval")


def timed(name: str, fn: Any) -> Any:
    cpu = name in CPU

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        c0 = time.thread_time() if cpu else 0.0
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            if cpu:
                EVENTS.append((name + " cpu", 0.0, time.thread_time() - c0))
            EVENTS.append((name, t0, t1))
    return wrapper


class TimedMx:
    """`mlx.core` as `_spec_step` sees it, with a few calls timed."""

    def __init__(self, mx: Any, prefix: str = ""):
        self._mx = mx
        for name in ("async_eval", "concatenate", "stack"):
            setattr(self, name, timed(prefix + name, getattr(mx, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mx, name)


class TimedModel:
    """A draft model whose calls (its forwards' graphs) are timed; the rest is the model's."""

    def __init__(self, model: Any):
        self._model = model
        self._call = timed("draft graph", model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def install() -> None:
    m = _spec_step
    m.mx = TimedMx(m.mx)
    m.rollback = timed("rollback", m.rollback)
    d = _drafting.Drafter
    d.propose = timed("propose", d.propose)
    d._fill = timed("draft fill", d._fill)
    _drafting.mx = TimedMx(_drafting.mx, "draft ")
    d.settle = timed("drafter.settle", d.settle)
    dec = m.Decoder
    dec.verify = timed("sample", dec.verify)
    dec.settle = timed("decoder.settle", dec.settle)
    from trio_mlx.actor import _batch
    _batch.CausalPrefill.verify = timed("forward", _batch.CausalPrefill.verify)  # the model's wrapper
    step = m.speculative_step

    def spec(decoder: Any, batch: Any) -> Any:
        EVENTS.append(("step<", time.perf_counter(), 0.0))
        c0 = time.thread_time()
        out = step(decoder, batch)
        EVENTS.append(("step cpu", 0.0, time.thread_time() - c0))
        EVENTS.append(("step>", time.perf_counter(), 1.0 if out is not None else 0.0))
        return out

    init = d.__init__

    def patched(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.step = spec
        if self.model is not None:  # the draft model's forwards: their graphs' building
            self.model = TimedModel(self.model)
    d.__init__ = patched


def phases(events: list[tuple[str, float, float]]) -> list[dict[str, float]]:
    """Each speculative step's phases in ms, from the event stream."""
    out: list[dict[str, float]] = []
    cur: list[tuple[str, float, float]] | None = None
    for ev in events:
        if ev[0] == "step<":
            cur = [ev]
        elif ev[0] == "step>" and cur is not None:
            if ev[2]:  # a step that speculated
                out.append(split(cur, ev[1]))
            cur = None
        elif cur is not None:
            cur.append(ev)
    return out


def split(evs: list[tuple[str, float, float]], end: float) -> dict[str, float]:
    start = evs[0][1]
    p: dict[str, float] = collections.defaultdict(float)
    for name, _, seconds in (e for e in evs if e[0].endswith(" cpu")):  # thread CPU, beside the walls
        p[name] += seconds * 1e3
    evs = [e for e in evs if not e[0].endswith(" cpu")]
    names = [e[0] for e in evs]
    for name, t0, t1 in evs[1:]:
        p[name] += (t1 - t0) * 1e3
    # the step's one async_eval of the logits comes after the forward's graph; the sampling's
    # own async_evals are inside `sample`; the read of the inputs is the gap after it
    fwd = names.index("forward") if "forward" in names else None
    if fwd is not None:
        ae = next((i for i in range(fwd + 1, len(evs)) if evs[i][0] == "async_eval"), None)
        if ae is not None:
            p["encode"] = (evs[ae][2] - evs[ae][1]) * 1e3
            nxt = evs[ae + 1][1] if ae + 1 < len(evs) else end
            p["read inputs"] = (nxt - evs[ae][2]) * 1e3
    samples = [e for e in evs if e[0] == "sample"]
    after = [e for e in evs if e[0] in ("rollback",)]
    if samples and after:
        p["wait targets"] = (after[0][1] - samples[-1][2]) * 1e3 - p.get("stack", 0.0)
    p["step"] = (end - start) * 1e3
    p["async_eval"] -= p.get("encode", 0.0)
    inner = ("draft graph", "draft async_eval", "draft concatenate", "draft stack", "draft fill")
    p["propose"] -= sum(p.get(k, 0.0) for k in inner)  # what is left of it: the drafter's own
    accounted = sum(v for k, v in p.items()
                    if k not in ("step", "async_eval", "concatenate", "stack") and not k.endswith(" cpu"))
    p["other"] = p["step"] - accounted - p["async_eval"] - p.get("concatenate", 0.0) - p.get("stack", 0.0)
    return p


def chain(model: Any, k: int, reps: int = 30) -> tuple[float, float]:
    """K greedy drafts chained on the device after a 128-token prompt, as the drafter makes
    them (`_drafting.py`: the first forward of two tokens, as `_draft_batch` feeds a row's
    last held token and its pending one, and `_draft` where every draft was kept; each
    draft `async_eval`ed as its graph is built, one read at the end), outside the engine:
    medians of (wall, this thread's CPU) ms."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from trio_mlx.actor._shapes import few_queries, prefill_grid
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(1, 129))]), cache=cache))
    walls, cpus = [], []
    with few_queries(prefill_grid()):
        for _ in range(reps):
            c0, t0 = time.thread_time(), time.perf_counter()
            x = mx.array([7, 9])
            for _ in range(k):
                x = mx.argmax(model(x[None], cache=cache)[:, -1], axis=-1)
                mx.async_eval(x)
            mx.eval(x)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.thread_time() - c0)
            for c in cache:
                c.trim(k + 1)
    return 1e3 * statistics.median(walls[3:]), 1e3 * statistics.median(cpus[3:])


async def chains(path: str, k: int) -> None:
    """The same drafts outside the engine, on this thread, a plain thread and `trio.to_thread`
    (the loop idle), alternated: what drafting costs with no engine beside it."""
    import threading

    from mlx_lm import load
    model, _ = load(path)
    got: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for _ in range(3):
        got["main thread"].append(chain(model, k))
        t = threading.Thread(target=lambda: got["a thread"].append(chain(model, k)))
        t.start()
        t.join()
        got["trio.to_thread"].append(await trio.to_thread.run_sync(chain, model, k))
    for where, runs in got.items():
        print(f"  {k} drafts outside the engine, {where:15s}: " + ", ".join(f"{w:.2f} ms ({c:.2f} CPU)" for w, c in runs))


def plain_median(trace: str) -> float | None:
    rows = [line.rstrip("\n").split("\t") for line in Path(trace).read_text().splitlines()]
    head = rows[0]
    steps = [dict(zip(head, r, strict=False)) for r in rows[1:] if r and r[0] != "t"]
    plain = [float(s["next_s"]) * 1e3 for s in steps if s["drafted"] == "0" and s["generated"] == "1"
             and s["prompt_tokens"] == "0"]
    return statistics.median(plain) if plain else None


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--configs", default="ngram,ngram8")
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--draft", default=None, help="the draft model of the draftK configurations")
    p.add_argument("--chain-only", type=int, default=0, metavar="REPS",
                   help="no engine: only `chain` of the draft model's 4 drafts, REPS times (for a profiler)")
    a = p.parse_args()
    if a.chain_only:
        from mlx_lm import load
        wall, cpu = chain(load(a.draft)[0], 4, a.chain_only)
        print(f"4 drafts: {wall:.2f} ms ({cpu:.2f} CPU), median of {a.chain_only}")
        return
    install()
    prompt = EDIT.format(src=(Path(__file__).parent / "edit_passage.txt").read_text())
    tmp = tempfile.mkdtemp()
    for name in a.configs.split(","):
        config: dict[str, Any] = {"speculative": "ngram"}
        if name.startswith("draft"):
            config = {"draft_model": a.draft}
        count = name.removeprefix("draft").removeprefix("ngram")  # K of ngramK, draftK
        if count.isdigit():
            config["num_draft_tokens"] = int(count)
        trace = f"{tmp}/{name}.tsv"
        async with trio_mlx.open_engine(a.model, step_trace=trace, **config) as engine:
            await one(engine, prompt, a.max_tokens)  # warm-up: kernels for the step's shapes
            EVENTS.clear()
            got = [await one(engine, prompt, a.max_tokens) for _ in range(max(1, a.repeats - 1))]
        steps = phases(EVENTS)
        keys = sorted({k for s in steps for k in s}, key=lambda k: -statistics.median(s.get(k, 0.0) for s in steps))
        tps = statistics.median(g["decode_tps"] for g in got)
        print(f"== {name}: {len(steps)} speculative steps, decode {tps:.1f} tok/s, drafted {got[-1]['drafted']}, "
              f"kept {got[-1]['accepted']}; plain step median {plain_median(trace) or 0:.2f} ms")
        for k in keys:
            vals = [s.get(k, 0.0) for s in steps]
            print(f"  {k:20s} median {statistics.median(vals):7.2f} ms  mean {statistics.fmean(vals):7.2f}")
        if name.startswith("draft"):
            await chains(a.draft, int(count) if count.isdigit() else 3)


if __name__ == "__main__":
    trio.run(main)
