"""Probe (CPU): the host's per-step grammar work for a batch of constrained rows, as the decode step does it.

    PYTHONPATH=. python benchmarks/probes/probe_grammar_host.py [--rows 64] [--max-tokens 256]
        [--schemas array,string] [--rounds 3] [--pick any|low] [--seed 0] [--split]
        [--profile SCHEMA] [--top 25] [--tokenizer /tmp/tok128k] [--pool-threads 1,4,12]
        [--lexers pool,1]

No model and no device: a 128k-vocabulary test tokenizer (`_test_models._write_test_tokenizer`,
written once under `--tokenizer`) and, per schema, `rows` rows that each get a
`GrammarProcessor` (max_tokens `--max-tokens`) and a `_decode.DecodeRow`. Each step
times `Decoder._masks` (advance every row's matcher by the token it was fed, fill the
masks, the budget checks: the host's whole grammar work for the step) and then plays
the model: each row's next token is drawn at random from what its mask allows (`any`:
uniform over the allowed ids, as a random-weight model over the 128k vocabulary does;
`low`: among the ids under 512 (the tokenizer's own, the rest are padding entries
`<|x123|>`) when the mask allows any). A row that draws EOS, or reaches max_tokens,
leaves the batch, as the actor retires it (a new plan, as the actor's step gets). Its
text must parse as JSON and its tokens stay within max_tokens, or the probe fails
(the string's rows, which cannot finish, must run to max_tokens).

Schemas: `array` (the grammar-budget figure's: 60 strings of at most 12 characters,
every row ends before max_tokens by its budget) and `string` (at least 100,000
characters: masked every step to max_tokens; the completion is past what `finish`
looks for, so the budget checks give up early). One warm-up episode per schema
first (a grammar's start completion is walked once per process, as in a server).
Rounds alternate the schemas. Prints, per round and schema: host ms per step (mean
over the episode's steps, and its first, middle and last thirds), the CPU per step of
the threads that hold the GIL (the decode step's, and the budget checks' where a tree ran
them in a thread of their own: work no number of cores spreads, and steadier than wall time
on a shared machine), the steps, the
tokens, and a digest of every mask of the episode (the same digest before and
after a change that must not change what rows may output, same `--seed`).
llguidance's batch calls run on its own pool: 80% of the cores (one thread on a
2-core machine, 12 on a 16-core GPU host), so the fill's share depends on the host;
their CPU is not in the GIL-side figure.

`--split`: one more episode per schema with each part timed apart (ms per step,
calls per step, us per call; wrappers add ~0.3 us a call): the batch consume
(`consume_many`), `begin`, the batch fill (`fill_many`, which includes waiting for
the budget checks that run beside it, `measure`), `complete`, and within the checks
`_measure` and the functions it calls (`completes`, `resumes`, `finish`, the
openers' `growth`). `--profile SCHEMA`: one more episode under cProfile (the
decoder's thread for the checks is not profiled), its `--top` costliest functions
by own time.

`--pool-threads N,...`: llguidance's pool at each of these sizes in turn, in every round
(its default: 80% of the cores). `--lexers L,...`: for each pool size, an episode with each
of these numbers of start matchers per grammar (`_constrain.LEXERS`: the rows are
dealt across that many lexers; `rule`, the default: the runtime's rule for the pool's size,
`_constrain.lexers_for`; `pool`: as many as the pool's threads, the rule before 2026-11-30;
`1`: every row a copy of one start, so one lexer's lock for the whole batch). `--split`
episodes take the runtime's rule.

Before and after a change, interleaved (a shared machine drifts): run it with
PYTHONPATH at each tree in turn, e.g. the base exported by
`git archive BASE trio_mlx | tar -x -C /tmp/base`.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import itertools
import json
import pathlib
import pstats
import statistics
import time
from collections import defaultdict
from typing import Any

import numpy as np

from trio_mlx import models
from trio_mlx.actor import _constrain, _decode
from trio_mlx.actor._constrain import GrammarProcessor
from trio_mlx.actor._matcher import grammar_vocab
from trio_mlx.engine import _grammar
from trio_mlx.models import _test_models

VOCAB = 128256
SCHEMAS: dict[str, dict[str, Any]] = {
    "array": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 60, "maxItems": 60},
    "string": {"type": "string", "minLength": 100_000},
}


STRING_SOURCE = [""]  # the string schema's grammar: its rows cannot finish within max_tokens
MEASURE_CPU = [0.0]  # CPU seconds a thread of the decoder's own for the budget checks spent in them
# A tree whose budget checks ran in such a thread, beside the fill, has this; later ones check
# after the fill, on the thread this probe times.
_measure_all = getattr(_decode, "_measure_all", None)


def _timed_measure_all(*args: Any) -> None:
    t = time.thread_time()
    try:
        _measure_all(*args)  # type: ignore[misc]
    finally:
        MEASURE_CPU[0] += time.thread_time() - t


if _measure_all is not None:
    _decode._measure_all = _timed_measure_all
POOL_THREADS: list[int | None] = [None]  # llguidance's pool size for the episodes to come (None: its default)
DEFAULT_POOL = _constrain.POOL_THREADS  # the runtime's pool, when --pool-threads gives none


def _sized_pool(self: _decode.Decoder) -> Any:
    if self._executor is None:
        import llguidance

        self._executor = llguidance.LLExecutor(num_threads=POOL_THREADS[0])
    return self._executor


_decode.Decoder._pool = _sized_pool  # type: ignore[method-assign]


def lexer_count(lexers: str, pool: int) -> int:
    """`--lexers`' word for a pool of `pool` threads as a number of lexers."""
    return {"rule": _constrain.lexers_for(pool), "pool": pool}.get(lexers) or int(lexers)


def tokenizer(path: pathlib.Path) -> Any:
    """The tokenizer in `path`; an empty or missing `path` gets the 128k test tokenizer written
    into it. A tokenizer without its config.json (EOS) is refused, never overwritten: this
    probe once wrote its test tokenizer over SmolLM2's staged that way, and its figures were
    then the test tokenizer's."""
    if (path / "tokenizer.json").exists() and not (path / "config.json").exists():
        raise SystemExit(f"{path} holds a tokenizer but no config.json: add one (its eos_token_id)")
    if not (path / "config.json").exists():
        path.mkdir(parents=True, exist_ok=True)
        _test_models._write_test_tokenizer(path, vocab_size=VOCAB, model_max_length=4096)
        (path / "config.json").write_text(json.dumps(
            {"model_type": "llama", "eos_token_id": 2, "bos_token_id": 1, "vocab_size": VOCAB}))
    return models.load_tokenizer(path)


class Row:
    def __init__(self, vocab: Any, source: str, max_tokens: int):
        self.proc = GrammarProcessor(vocab, source, max_tokens)
        self.row = _decode.DecodeRow(_decode.SamplingParams(temperature=0.0), grammar=self.proc)
        self.tokens: list[int] = []


def episode(vocab: Any, source: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    source_parses = source != STRING_SOURCE[0]
    rng = np.random.default_rng(seed)
    rows = [Row(vocab, source, args.max_tokens) for _ in range(args.rows)]
    eos = set(vocab.eos)
    dec = _decode.Decoder()
    live = list(rows)
    fed: list[int] | None = None
    times: list[float] = []
    cpus: list[float] = []  # CPU seconds of the threads that hold the GIL: this one (and the budget checks')
    digest = hashlib.sha256()
    low = -(-512 // 32)
    while live:
        plan = dec._plan_for([r.row for r in live], VOCAB)
        t0, c0, m0 = time.perf_counter(), time.thread_time(), MEASURE_CPU[0]
        dec._masks(plan, fed)
        times.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0 + MEASURE_CPU[0] - m0)
        assert plan.bitmask is not None
        words = plan.bitmask.view(np.uint32)
        digest.update(words.tobytes())
        going = []
        for j, r in enumerate(live):
            w = words[j]
            if args.pick == "low" and w[:low].any():
                w = w[:low]
            ids = np.flatnonzero(np.unpackbits(w.view(np.uint8), bitorder="little"))
            assert len(ids), "a row's mask allows nothing"
            t = int(ids[rng.integers(len(ids))])
            r.tokens.append(t)
            if t not in eos and len(r.tokens) < args.max_tokens:
                going.append(r)
        live = going
        fed = [r.tokens[-1] for r in live]
    for r in rows:
        assert len(r.tokens) <= args.max_tokens
        body = r.tokens[:-1] if r.tokens[-1] in eos else r.tokens
        text = vocab.tokenizer.decode_bytes(body).decode("utf-8", errors="replace" if not source_parses else "strict")
        assert r.tokens[-1] in eos, f"a row ended without EOS: {text[-60:]!r}"
        if source_parses:
            json.loads(text)  # the output parses
        else:  # no completion within reach: the row runs to max_tokens
            assert len(r.tokens) == args.max_tokens
        assert r.proc.error is None, r.proc.error
    ms = [1e3 * t for t in times]
    third = max(1, len(ms) // 3)
    return {
        "ms": statistics.fmean(ms), "thirds": [statistics.fmean(ms[k * third:(k + 1) * third] or [0.0])
                                             for k in range(3)],
        "cpu": 1e3 * statistics.fmean(cpus),
        "cpu_thirds": [1e3 * statistics.fmean(cpus[k * third:(k + 1) * third] or [0.0]) for k in range(3)],
        "steps": len(ms), "tokens": sum(len(r.tokens) for r in rows), "total": sum(ms),
        "forced": sum(r.proc.forced_finish for r in rows), "digest": digest.hexdigest()[:12],
    }


def timed(clock: dict[str, float], counts: dict[str, int], name: str, fn: Any) -> Any:
    def call(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            clock[name] += time.perf_counter() - t
            counts[name] += 1
    return call


def split(vocab: Any, source: str, args: argparse.Namespace) -> None:
    clock: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    saved = {n: getattr(GrammarProcessor, n) for n in ("begin", "measure", "fill", "complete", "_measure")
             if hasattr(GrammarProcessor, n)}
    saved_many = _decode.Decoder._fill_many
    saved_consume = getattr(_decode.Decoder, "_consume_many", None)
    checks = ("completes", "resumes", "finish", "jump", "growth")  # what `_measure` calls (_constrain's names)
    saved_checks = {n: getattr(_constrain, n) for n in checks if hasattr(_constrain, n)}
    try:
        for n, f in saved.items():
            setattr(GrammarProcessor, n, timed(clock, counts, n, f))
        for n, f in saved_checks.items():
            setattr(_constrain, n, timed(clock, counts, n, f))
        _decode.Decoder._fill_many = timed(clock, counts, "fill_many", saved_many)  # type: ignore[method-assign]
        if saved_consume is not None:
            _decode.Decoder._consume_many = timed(clock, counts, "consume_many", saved_consume)  # type: ignore[method-assign]
        out = episode(vocab, source, args, args.seed)
    finally:
        if saved_consume is not None:
            _decode.Decoder._consume_many = saved_consume  # type: ignore[method-assign]
        for n, f in saved.items():
            setattr(GrammarProcessor, n, f)
        for n, f in saved_checks.items():
            setattr(_constrain, n, f)
        _decode.Decoder._fill_many = saved_many  # type: ignore[method-assign]
    steps = out["steps"]
    print(f"  split over {steps} steps ({out['ms']:.2f} ms/step with the wrappers), ms per step:")
    for n in ("consume_many", "begin", "fill_many", "measure", "fill", "complete", "_measure", *checks):
        if counts[n]:
            print(f"    {n:10s} {1e3 * clock[n] / steps:7.3f}  ({counts[n] / steps:.1f} calls/step, "
                  f"{1e6 * clock[n] / counts[n]:.1f} us/call)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--schemas", default="array,string")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pick", choices=("any", "low"), default="any")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", action="store_true")
    ap.add_argument("--profile", default="")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--tokenizer", default="/tmp/tok128k")
    ap.add_argument("--pool-threads", default="")
    ap.add_argument("--lexers", default="rule")
    args = ap.parse_args()
    sizes: list[int | None] = [int(x) for x in args.pool_threads.split(",") if x] or [None]
    tok = tokenizer(pathlib.Path(args.tokenizer))
    vocab = grammar_vocab(tok)
    sources = {}
    for name in args.schemas.split(","):
        g = _grammar.compile_response_format(tok, {"type": "json_schema", "json_schema": {"schema": SCHEMAS[name]}})
        assert g is not None
        sources[name] = g.source
        if name == "string":
            STRING_SOURCE[0] = g.source
        t0 = time.perf_counter()
        episode(vocab, g.source, args, args.seed + 999)  # warm-up: the grammar's start tail is kept
        print(f"{name}: warm-up episode {time.perf_counter() - t0:.2f} s", flush=True)
    for rnd in range(args.rounds):
        for name, source in sources.items():
            for size, lexers in itertools.product(sizes, args.lexers.split(",")):
                POOL_THREADS[0] = size
                _constrain.LEXERS = lexer_count(lexers, size or DEFAULT_POOL)
                o = episode(vocab, source, args, args.seed)
                pool = "" if size is None else f" pool {size:2d}"
                pool += f" lexers {_constrain.LEXERS:2d}"
                print(f"round {rnd} {name:6s}{pool} host {o['ms']:6.2f} ms/step (thirds "
                      + " / ".join(f"{x:.2f}" for x in o["thirds"])
                      + f"), GIL-side CPU {o['cpu']:5.2f} ms/step (thirds "
                      + " / ".join(f"{x:.2f}" for x in o["cpu_thirds"])
                      + f"), {o['steps']} steps, {o['tokens']} tokens, {o['total']:.0f} ms in all, "
                      f"{o['forced']} forced, masks {o['digest']}", flush=True)
    if args.split:
        for name, source in sources.items():
            for size in sizes:
                POOL_THREADS[0] = size
                _constrain.LEXERS = _constrain.lexers_for(size or DEFAULT_POOL)
                print(name if size is None else f"{name}, pool {size}")
                split(vocab, source, args)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        episode(vocab, sources[args.profile], args, args.seed)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
