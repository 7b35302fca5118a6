"""Warm-up: visit, before the server reports ready, every path live traffic will make MLX
compile, so no request pays a kernel compile (seconds on CUDA): every prefill group size
(`warm_up`), the shape grid's prefills (`prebuild_prefill`), the padded decode step's attention
kernels (`prebuild_masked_decode`), the matmuls of every row count (`prebuild_matmuls`), and a
rehearsal of the actor's own paths through its own steps (`rehearse`). `Actor._warmup` runs them."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import mlx.core as mx

from . import _cuda_attention
from ._admission import Admission
from ._batch import CausalPrefill
from ._constrain import json_string_grammar, model_vocab
from ._prompt_cache import PromptCache
from ._protocol import Abort, ActorConfig, Command, Grammar, SamplingParams, StepReport, Submit
from ._reuse import Reuse
from ._schedule import Schedule
from ._shapes import GRID_PREBUILD, GRID_PREFIX, grid_sizes
from ._speculate import START_DRAFT
from ._tuning import ActorTuning

WARMUP_PROMPT = 128  # tokens per warm-up prompt on a GPU (see warm_up)
# The rehearsal's constrained row: any JSON string (llguidance's grammar text).
_WARM_GRAMMAR = Grammar(source=json_string_grammar(), min_tokens=2, kind="json_schema")


def warm_up(bg: Any, token: int, length: int, groups: int, row: Callable[[], Any] | None = None) -> None:
    """Prefill 1, 2, ... `groups` prompts of `length` tokens at once, each group to
    its first tokens. Leaves `bg` empty. With `row`, each sequence's sampler is a fresh
    `row()` (the actor's own decode step, `_batch.own_decode`, which ends no row by
    itself: the group is removed once done).

    MLX compiles GPU kernels the first time it meets a shape, and on CUDA
    that can stall a step for seconds (tens of seconds for a 4-bit model's
    first prefill, tens to hundreds of ms for each new group size of a bf16
    one, against a few ms after). Live traffic admits groups of every
    size up to the prefill batch, so each size is visited here, before the
    server reports ready, rather than in the middle of someone's stream.
    The prompt length (128 tokens on a GPU, less for a small context) is a
    judgement call: a typical chat turn. On the CPU, where MLX has no such
    stalls to hide and prefill is slow, one short sequence is enough.
    """
    for k in range(1, groups + 1):
        samplers = None if row is None else [row() for _ in range(k)]
        uids = bg.insert([[token] * length for _ in range(k)], max_tokens=[2] * k, samplers=samplers)
        _step_until(bg, lambda gen: all(n >= 2 for n in gen.values()), uids)
        bg.remove(uids)  # those still there (mlx_lm's own step ends them at max_tokens)


def _step_until(bg: Any, done: Callable[[dict[int, int]], bool], uids: list[int]) -> None:
    """Call `bg.next()` until `done(tokens generated so far per uid)`; the bound of
    64 steps only guards a bug."""
    generated: dict[int, int] = dict.fromkeys(uids, 0)
    for _ in range(64):
        _, responses = bg.next()
        for uid in getattr(responses, "uids", None) or [r.uid for r in responses]:  # `_batch.Decoded`, or a list
            if uid in generated:
                generated[uid] += 1
        if done(generated):
            return
    raise RuntimeError(f"warm-up: no progress after 64 steps ({generated})")


def prebuild_cuda(model: Any, token: int, context: int, tuning: ActorTuning, drafter: Any, grid: bool) -> int:
    """CUDA's prebuilds, in turn: where prefills run on the shape `grid`, its prefills and the
    padded decode steps; for every model, the matmuls of every row count a step may take (a
    decode step's `max_batch` rows, or a speculative step's `drafter.max_rows` rows of
    `drafter.k` drafts and a token). Returns how many prefill shapes ran."""
    ran = 0
    if grid:
        forward, layers = CausalPrefill(model, grid=True), len(model.layers)
        ran = prebuild_prefill(forward, layers, token, min(context, GRID_PREBUILD), grid_sizes(tuning.prefill_step),
                               GRID_PREFIX)
        prebuild_masked_decode(forward, layers, token)
    spec = drafter.max_rows * (drafter.k + 1) if drafter is not None else 0
    prebuild_matmuls(model, token, max(tuning.max_batch, spec), context)
    return ran


def prebuild_prefill(forward: Any, layers: int, token: int, limit: int, sizes: list[int], stride: int) -> int:
    """Run, once each, the prefill shapes of the grid (`_batch.CausalPrefill`) that fit in
    `limit` tokens of context, for one row: a query of each length in `sizes` behind every
    multiple of `stride` tokens already cached. Returns how many shapes it ran.

    On CUDA, MLX builds a cuDNN graph for every prefill attention shape it meets, at tens
    of ms each, and a chat's turns would otherwise pay one each. `forward` is the grid-prefilling model, so the shapes (and
    the contiguous keys' strides) are the ones live prefills make. Groups of several rows
    meet their shapes live, and these recur: the grid is coarse.
    """
    from mlx_lm.models.cache import BatchKVCache

    caches = [BatchKVCache([0]) for _ in range(layers)]
    ran, cached = 0, 0
    while True:
        for q in sizes:
            if cached + q > limit:
                break
            forward(mx.full((1, q), token, dtype=mx.int32), cache=caches)
            mx.eval([a for c in caches for a in (c.keys, c.values)])
            for c in caches:
                c.trim(q)
            ran += 1
        if cached + stride + min(sizes) > limit:  # no query would fit behind one more stride
            return ran
        forward(mx.full((1, stride), token, dtype=mx.int32), cache=caches)
        mx.eval([a for c in caches for a in (c.keys, c.values)])
        cached += stride


def prebuild_masked_decode(forward: Any, layers: int, token: int) -> None:
    """Run a decode step of two left-padded rows behind a short context and one behind a
    long context. `forward` is the grid-prefilling model.

    On CUDA, such a step's attention takes `_cuda_attention`'s kernels, which NVRTC
    compiles (~1 s each) the first time they meet the model's types and head counts: the
    kernel over all the keys, and the one that splits them with the kernel that combines the
    splits (a narrow batch behind a long context). Live traffic would otherwise compile them
    in someone's stream: the first step of rows of different lengths, then the first
    behind a longer context.
    """
    from mlx_lm.models.cache import BatchKVCache

    for keys in (8, 4 * _cuda_attention.MIN_KEYS):
        caches = [BatchKVCache([0, 1]) for _ in range(layers)]
        forward(mx.full((2, keys), token, dtype=mx.int32), cache=caches)
        mx.eval(forward(mx.full((2, 1), token, dtype=mx.int32), cache=caches))


# Tokens of the one-row forwards `prebuild_matmuls` runs: one of each row-count class of
# MLX 0.32.4's quantized matmul on CUDA, up to the most a step multiplies. Below 8 rows it
# takes its matrix-vector kernel (`qmv`); from 8 a tiled one compiled per tile height: 16
# rows (8-16), 32 (17-32), 64 (33 and more); more than 64, in case.
MATMUL_ROWS = (2, 9, 17, 33, 65, 129, 257)


def prebuild_matmuls(model: Any, token: int, most: int, context: int) -> list[int]:
    """Run `model` over one row of `MATMUL_ROWS` tokens, each from an empty cache of its own
    (a prefill of that many tokens), up to the first that reaches `most` (the most rows a
    step's matmuls take: a decode step's rows, or a speculative step's rows times its
    tokens) and within `context`, each position's logits evaluated; returns their lengths.

    On CUDA, MLX 0.32.4's quantized matmul compiles a kernel (NVRTC, ~16 s each on an
    H200's host) for each class of row counts it meets, per bit width. A prefill meets
    them in the model's layers but not in its output head, whose logits it takes at the
    last position alone (the others are never evaluated), and the warm-up's decode steps
    go up to the prefill groups' rows: the head of an 8-bit-headed model first met 33 rows in
    a live speculative step of 32 drafts, which stalled 15.3 s compiling it (BENCHMARKS.md,
    "What the runtime does because of a measurement"), as a first decode step of 33 rows
    would; and a 4-bit model's layers first met 8-16 rows in a speculative step of 14
    drafts (31.7 s, its warm-up's groups of at most 4 rows under a `max_batch` of 4), as a
    decode step of 8-16 rows would where the groups stop under 8 (a `prefill_batch` under 8).
    """
    from mlx_lm.models.cache import make_prompt_cache

    ran: list[int] = []
    for n in MATMUL_ROWS:
        if n > context:
            break
        mx.eval(model(mx.full((1, n), token, dtype=mx.int32), cache=make_prompt_cache(model)))
        ran.append(n)
        if n >= most:
            break
    return ran


class Rehearsed(Protocol):
    """What the rehearsal drives of the actor (`_actor.Actor`): its own steps, its
    admission and its prompt cache."""

    config: ActorConfig
    schedule: Schedule
    _admission: Admission
    _reuse: Reuse
    _context: int
    _drafter: Any  # speculative decoding's (`_drafting.Drafter`), or None
    _adapters: Any  # each row's named LoRA adapter (`_row_adapters.RowAdapters`), or None

    def _open_cache(self) -> None: ...
    def _apply(self, commands: Sequence[Command]) -> list[tuple[int, str]] | None: ...
    def _step(self, failed: list[tuple[int, str]]) -> StepReport: ...
    def settle(self, link: Any = None) -> StepReport | None: ...


def rehearse(actor: Rehearsed, token: int, length: int) -> None:
    """Serve a short script of requests through the actor's own `_apply` and
    `_step`, as live traffic would; the caller forgets them (`Actor._reset_batch`).

    On CUDA, MLX compiles some kernels (with NVRTC, for seconds) the first
    time an operation meets a dtype, not a shape. The prefill groups of
    `warm_up` never remove a row that others outlive, and the first such
    removal, gathering the kept rows' next tokens (`gather_uint32_int32`),
    would stall a live decode step for seconds. The warm-up exists so that no
    request pays a compile after ready (BENCHMARKS.md, "What the runtime does
    because of a measurement").
    Sampling, penalties, logit bias and logprobs have kernels of their own.
    The script: A (greedy) decodes; B (every sampling option, logprobs)
    and C (seeded, held to a JSON grammar: the mask's kernels, and the
    tokenizer's grammar vocabulary built now rather than at the first
    constrained request) join it, padded; A finishes and retires; D enters, so
    A's row leaves with B and C kept, trimming the padding they share; C
    is aborted; the rest finish and the batch runs dry. The prompt cache is
    open meanwhile (and emptied after): A's prompt and answer are copied out
    as its row leaves, and D, with A's prompt, enters with that KV. C's prompt
    differs from B's, so that it does not wait for B's prefill. With named LoRA adapters, B
    and D run on the first one: a prefill and steps on one adapter, and steps of a batch
    mixing rows on it with rows on none (`mx.gather_mm`'s kernels).
    """
    admission = actor._admission
    actor._admission = Admission(0.0, actor.config.tuning.prefill_batch)  # no waiting for company
    prompt = (token,) * length
    every = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
                           presence_penalty=0.5, frequency_penalty=0.5, logit_bias=((token, 1.0),),
                           logprobs=True, top_logprobs=5)
    a, b, c, d = -1, -2, -3, -4  # rids no request has
    adapter = actor._adapters.selector.names[0] if actor._adapters is not None else None
    script: list[tuple[list[Command], Callable[[collections.Counter[int]], bool]]] = [
        ([Submit(a, prompt, 8, SamplingParams(temperature=0.0), frozenset())], lambda n: n[a] >= 3),
        ([Submit(b, prompt, 12, every, frozenset(), adapter=adapter),
          Submit(c, (token + 1,) + prompt[1:], 12, SamplingParams(temperature=0.7, seed=0), frozenset(),
                 _warm_grammar(actor.config.model_path))],
         lambda n: n[a] >= 8),
        ([Submit(d, prompt, 4, SamplingParams(temperature=0.0), frozenset(), adapter=adapter)],
         lambda n: n[d] >= 2),
        ([Abort(c)], lambda n: not actor.schedule.seqs),
    ]
    if actor._drafter is not None:
        # Two rows' speculative steps side by side, then the longer one's alone, seeded, with
        # every option (the other greedy); biased to repeat their prompts, so that prompt
        # lookup's guesses hit (it drafts after the first few: `_speculate.GUESS_HITS`) and
        # the target keeps the drafts. (H's prompt differs, so that H does not wait for G's
        # prefill, and is a token shorter: rows in lockstep do not speculate side by side,
        # `_spec_step.py`.) G outlasts H by more than a step's drafts (prompt lookup's grow from
        # `START_DRAFT`), so that it speculates alone after H has ended; within the script's
        # bound of steps with a draft model's few drafts a step.
        g, h = -7, -8
        bias = ((token, 100.0),)
        longer = 10 + 2 * START_DRAFT + 8
        script.append(([Submit(g, prompt, longer, dataclasses.replace(every, seed=1, logit_bias=bias), frozenset()),
                        Submit(h, (token + 1,) + prompt[2:], 10, SamplingParams(temperature=0.0, logit_bias=bias),
                               frozenset())],
                       lambda n: n[g] >= longer and n[h] >= 10))
    if mx.cuda.is_available() and (long := min(actor._context - 80, 2 * actor.config.tuning.prefill_step + 64)) > 2 * length:
        # A long prompt, in full chunks and beside a long context, stored as it is
        # prefilled, then a prompt that extends it (a hit): otherwise a chat's first long
        # prompts would pay for the kernels they compile, many times their prefill.
        e, f = -5, -6
        story = (token,) * long
        script += [
            ([Submit(e, story, 2, SamplingParams(temperature=0.0), frozenset())], lambda n: n[e] >= 2),
            ([Submit(f, story + (token + 1,) * 64, 2, SamplingParams(temperature=0.0), frozenset())],
             lambda n: n[f] >= 2),
        ]
    counts: collections.Counter[int] = collections.Counter()
    actor._open_cache()
    unjudged = actor._drafter.unjudged() if actor._drafter is not None else contextlib.nullcontext()
    try:
        with unjudged:
            _run_script(actor, script, counts)
    finally:
        actor._admission = admission
        actor._reuse = Reuse(PromptCache(0))


def _run_script(actor: Rehearsed, script: list[tuple[list[Command], Callable[[collections.Counter[int]], bool]]],
                counts: collections.Counter[int]) -> None:
    """The rehearsal's script, step by step: each command list, then steps until its test holds."""
    for commands, done in script:
        failed = actor._apply(commands)
        for _ in range(64):  # the bound only guards a bug
            report = actor._step(failed or [])
            if report.failed:
                raise RuntimeError(f"warm-up rehearsal failed: {report.failed}")
            counts.update(t.rid for t in report.tokens)
            if done(counts):
                break
            failed = actor._apply([])
        else:
            raise RuntimeError(f"warm-up rehearsal made no progress: {dict(counts)}")
    actor.settle()  # the dry batch's rows leave, as once a live step's report is over


def _warm_grammar(model_path: os.PathLike[str]) -> Grammar | None:
    """The rehearsal's grammar, if this model's tokenizer takes constrained decoding."""
    try:
        model_vocab(model_path)
    except Exception:  # its requests get a 400 from the engine; nothing to warm
        return None
    return _WARM_GRAMMAR
