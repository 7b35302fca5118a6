"""The actor's own decode step: every row's logits processing and sampling as array ops over the batch.

mlx-lm's `GenerationBatch` calls each row's sampler and logits processors in a
Python loop, splits the batch's log-probabilities into one array per row, and
feeds every processor its row's whole token history; a grammar row reads the
last token back (`.item()`) in the middle of building the step. Here the batch
is one set of arrays: a step is one forward (`_batch.own_decode` hooks it into
mlx-lm's batch, whose KV cache classes it keeps) and then `Decoder.step`, which
processes and samples every row at once, with per-row parameters held as arrays
and rebuilt only when rows enter or leave (`_Plan`).

What a step computes for each row, in the order mlx-lm's processors ran:

1. `logit_bias` (one scatter-add over the batch);
2. the repetition penalty, over the prompt's and the generated tokens (HF's rule:
   a seen token's logit is divided by the penalty, or multiplied when negative);
3. the presence and frequency penalties, over the generated tokens only (OpenAI's
   rule: `- presence * [count > 0] - frequency * count`);
4. a constrained row's grammar mask (`_constrain.GrammarProcessor`), tokens it
   forbids at -inf;
5. for rows that ask, the chosen token's log-probability and the top ones, from
   the log-softmax of the logits as processed so far (as mlx-lm reports them);
6. the token: greedy rows take the argmax; sampling rows filter the
   log-probabilities by top-p, min-p and top-k (mlx-lm's `apply_top_p`,
   `apply_min_p`, `apply_top_k` as one threshold per row), scale by 1/temperature
   and draw by Gumbel-max. A seeded row's noise comes from its own key, made from
   its seed and its step count (`_sampling._mix64`), so its tokens do not depend on
   what else shares the batch; every other row's from MLX's global PRNG, which a
   distributed group seeds alike on every rank.

Pipelined as `mlx_lm.generate.generate_step` is: the step's whole graph (the
forward of the tokens sampled last step, still being computed, and this step's
sampling) is built and started with `mx.async_eval` before last step's tokens
are read back to the host. A batch with grammar rows starts its forward first,
reads last step's tokens (the matchers need them), computes the masks on the
host while the device runs the forward (llguidance's batch fill releases the
GIL and uses threads of its own), then builds and starts the sampling.

That hides the masks behind the device's work, not the host's: where the step
is bound by the host building and encoding the forward (a small model; the
device waits for it), the masks follow that work. With `grammar_masks` 'before'
(`masks_first`) the step builds the forward's graph, then reads last step's tokens
and fills the masks in a thread of the decoder's own while MLX encodes and starts
the forward (`mx.async_eval` releases the GIL), so the two host jobs overlap; it
costs the pipelining where the device is the slower side (the host waits for last
step's tokens before it starts this one's forward).
'auto' (`ActorTuning`'s default) takes 'before' while the tokens were ready when read after
the forward was started (the device waiting for the host), checked again every
`AUTO_RECHECK` constrained steps, while the batch holds `AUTO_ROWS` grammar rows
or more, and while the read that 'before' makes first waits less than the masks
take (what it costs against what it hides: on a GPU 'before' lost to 'after' at
one row of a cheap grammar and won at eight and 64 rows, BENCHMARKS.md).

No mlx-lm here: `_batch.py` holds every use of its internals.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mlx.core as mx
import numpy as np

from . import _constrain
from ._constrain import GrammarProcessor
from ._matcher import is_panic
from ._protocol import SamplingParams
from ._sampling import _mix64

_serials = itertools.count()
# Plain steps' times kept per batch width (their median judges speculative steps), and the
# speculative steps of a width after which it times a plain step again (`Decoder.wants_plain`):
# two plain steps in so many cost a speculating row about 1% of its tokens.
PLAIN_TIMES = 16
PLAIN_REFRESH = 128
# `grammar_masks` 'auto': a read of last step's tokens, made after the forward was started,
# that waited less than this (the median of the last AUTO_READS) says the device waits for the
# host; constrained steps between two such reads, and between two 'before' steps that time
# the read it makes first again while that read waited longer than the masks took.
AUTO_WAIT = 0.0002
AUTO_READS = 8
AUTO_RECHECK = 32
# `grammar_masks` 'auto': a batch with fewer grammar rows than this keeps its masks after the
# forward. On an H200 (the 1B shape, JSON grammars, paired in one engine) 'before' made
# 0.65-1.03x of 'after' at one row (median 0.94 over 11 rounds), its masks handed to the
# decoder's thread for little to hide, and 1.00-1.37x at eight rows and 1.07-1.18x at 64
# (BENCHMARKS.md); between one and eight nothing is measured, so those stay with 'after'.
AUTO_ROWS = 8


class DecodeRow:
    """One decoding sequence as the decode step sees it: its sampling, its grammar, its state.

    The actor makes one per sequence and inserts it as the row's "sampler"; mlx-lm's
    batches carry it through their per-row lists (filter, extend, split), so it stays
    with its row whatever else enters or leaves. Not callable: a step of mlx-lm's own
    that met it would fail at once rather than sample with the wrong rule."""

    __slots__ = ("serial", "sampling", "prompt", "grammar", "steps", "counts", "seen", "pending", "out",
                 "max_tokens", "stops", "spec", "fresh")

    def __init__(self, sampling: SamplingParams, prompt: Sequence[int] = (), grammar: GrammarProcessor | None = None,
                 max_tokens: int = 0, stops: frozenset[int] = frozenset()):
        self.serial = next(_serials)  # identifies the row in a plan's key: ids of freed objects recur
        self.sampling = sampling
        self.prompt = tuple(prompt)  # the repetition penalty's first tokens
        self.grammar = grammar
        # What speculation reads (`_drafting.py`): the row's answer limit (0: unknown, no
        # speculation) and stop tokens, and its speculation state (`_speculate.RowSpec`).
        self.max_tokens = max_tokens
        self.stops = stops
        self.spec: Any = None
        self.steps = 0  # tokens sampled for this row so far (a seeded row's key counter)
        self.counts: Any = None  # (1, V) float32: how often each token was generated (penalty rows)
        self.seen: Any = None  # (1, V) float32: 1 where the prompt or the output holds the token
        self.pending: tuple[_Logprobs, int] | None = None  # logprobs of the token sampled last, on the device
        self.out: tuple[float, tuple[tuple[int, float], ...] | None] | None = None  # ... read: (logprob, top)
        # Fed its prompt's last token in a step of the decoding batch (`_batch._join`): that
        # step is its first, and its grammar is fed nothing
        self.fresh = False

    @property
    def penalized(self) -> bool:
        sp = self.sampling
        return sp.repetition_penalty != 1.0 or bool(sp.presence_penalty) or bool(sp.frequency_penalty)


class _Logprobs:
    """One step's log-probabilities for the rows that asked, on the device until `read`."""

    __slots__ = ("chosen", "idx", "vals", "_host")

    def __init__(self, chosen: Any, idx: Any, vals: Any):
        self.chosen, self.idx, self.vals = chosen, idx, vals
        self._host: tuple[list[float], list[list[int]], list[list[float]]] | None = None

    def arrays(self) -> list[Any]:
        return [self.chosen] if self.idx is None else [self.chosen, self.idx, self.vals]

    def read(self, i: int, top: int) -> tuple[float, tuple[tuple[int, float], ...] | None]:
        if self._host is None:
            chosen: list[float] = self.chosen.tolist()  # type: ignore[assignment]
            idx: list[list[int]] = [] if self.idx is None else self.idx.tolist()  # type: ignore[assignment]
            vals: list[list[float]] = [] if self.vals is None else self.vals.tolist()  # type: ignore[assignment]
            self._host = (chosen, idx, vals)
        chosen, idx, vals = self._host
        if not top:
            return chosen[i], None
        pairs = sorted(zip(idx[i], vals[i], strict=True), key=lambda p: -p[1])
        return chosen[i], tuple(pairs[:top])


class _Plan:
    """The batch's per-row parameters as arrays, for one composition of rows (its `key`)."""

    def __init__(self, rows: Sequence[DecodeRow], width: int):
        self.key = tuple(r.serial for r in rows)
        self.rows = list(rows)
        self.width = width
        n = len(rows)
        sps = [r.sampling for r in rows]
        greedy = [sp.greedy for sp in sps]
        self.all_greedy = all(greedy)
        self.greedy = mx.array(greedy) if any(greedy) and not self.all_greedy else None
        sampling = [i for i in range(n) if not greedy[i]]
        self.inv_temp: Any = None
        self.top_p: Any = None
        self.top_k: Any = None
        self.min_p: Any = None
        self.sort = self.use_min_p = self.unseeded = False
        self.seeded: list[int] = []
        if sampling:
            self.inv_temp = mx.array([1.0 if g else 1.0 / sp.temperature for g, sp in zip(greedy, sps, strict=True)])[:, None]
            p = [0.0 < sp.top_p < 1.0 and not g for g, sp in zip(greedy, sps, strict=True)]
            k = [0 < sp.top_k < width and not g for g, sp in zip(greedy, sps, strict=True)]
            m = [sp.min_p > 0.0 and not g for g, sp in zip(greedy, sps, strict=True)]
            self.sort = any(p) or any(k)
            if self.sort:
                self.top_p = mx.array([sp.top_p if on else 2.0 for on, sp in zip(p, sps, strict=True)])[:, None]
                # index of the k-th largest in an ascending sort; 0 keeps every token
                self.top_k = mx.array([width - sp.top_k if on else 0 for on, sp in zip(k, sps, strict=True)])[:, None]
            self.use_min_p = any(m)
            if self.use_min_p:
                self.min_p = mx.array([math.log(sp.min_p) if on else -math.inf for on, sp in zip(m, sps, strict=True)])[:, None]
            self.seeded = [i for i in sampling if sps[i].seed is not None]
            self.unseeded = len(self.seeded) < len(sampling)
        bias = [(i, t, v) for i, sp in enumerate(sps) for t, v in sp.logit_bias]
        self.bias: tuple[Any, Any, Any] | None = None
        if bias:
            self.bias = (mx.array([b[0] for b in bias]), mx.array([b[1] for b in bias]),
                         mx.array([b[2] for b in bias], dtype=mx.float32))
        self.penalized = [i for i, r in enumerate(rows) if r.penalized]
        self.counts: Any = None
        self.seen: Any = None
        self.rep: Any = None
        self.pres: Any = None
        self.freq: Any = None
        self.pen_idx: Any = None
        if self.penalized:
            for i in self.penalized:
                _init_penalty_state(rows[i], width)
            self.counts = mx.concatenate([rows[i].counts for i in self.penalized])
            self.seen = mx.concatenate([rows[i].seen for i in self.penalized])
            pen = [sps[i] for i in self.penalized]
            self.rep = mx.array([sp.repetition_penalty for sp in pen])[:, None]
            self.pres = mx.array([sp.presence_penalty for sp in pen])[:, None]
            self.freq = mx.array([sp.frequency_penalty for sp in pen])[:, None]
            self.pen_idx = mx.array(self.penalized)
        self.logprobs = [i for i, sp in enumerate(sps) if sp.logprobs]
        self.top = max((sps[i].top_logprobs for i in self.logprobs), default=0)
        self.lp_idx: Any = mx.array(self.logprobs) if self.logprobs else None
        self.grammar = [i for i, r in enumerate(rows) if r.grammar is not None]
        # The grammar rows' masks, filled in place into one of two MLX arrays through numpy views
        # of their buffers (MLX documents such views as writable), which the step hands to its
        # sampling as they are: no copy of the batch's bitmask on the actor thread each step (on
        # CUDA MLX's buffers are managed memory, and a copy a host write into pages the device
        # read: BENCHMARKS.md). llguidance's batch fill writes the views on its own threads.
        # Two, alternating (`turn`): the array a step's masks go to was last read by the step
        # before the one before it, whose tokens the host has read back before any fill.
        self.g_idx: Any = None
        self._masks: list[Any] = []
        self._whole: list[np.ndarray] = []  # per array: a numpy view of its buffer (llguidance's int32)
        self._views: list[list[np.ndarray]] = []  # ... and each grammar row's slice of it
        self._turn = 0
        if self.grammar:
            first = rows[self.grammar[0]].grammar
            assert first is not None
            words = first.new_bitmask(1).shape[1]
            # from host memory: ready at once, where `mx.zeros` would wait for the device's queue
            self._masks = [mx.array(np.zeros((len(self.grammar), words), dtype=np.uint32)) for _ in range(2)]
            self._whole = [np.asarray(memoryview(m)).view(np.int32) for m in self._masks]
            self._views = [[v[j : j + 1] for j in range(len(self.grammar))] for v in self._whole]
            self._bind(0)
            self.g_idx = mx.array(self.grammar)

    @property
    def bitmask(self) -> np.ndarray | None:
        """The view the rows' masks are filled into this step; None without grammar rows."""
        return self._whole[self._turn] if self._whole else None

    def next_masks(self) -> None:
        """Turn to the other mask array: call before filling a step's masks."""
        self._bind(self._turn ^ 1)

    @property
    def masks(self) -> Any:
        """The MLX array the rows' masks were last filled into (grammar rows, words) uint32."""
        return self._masks[self._turn]

    def _bind(self, turn: int) -> None:
        self._turn = turn
        for i, view in zip(self.grammar, self._views[turn], strict=True):
            g = self.rows[i].grammar
            assert g is not None
            g.bind(view)

    def write_back(self) -> None:
        """Hand the penalty state back to its rows (lazy slices), before another plan takes over."""
        for j, i in enumerate(self.penalized):
            row = self.rows[i]
            row.counts, row.seen = self.counts[j : j + 1], self.seen[j : j + 1]


def _allowed(masks: Any, width: int) -> Any:
    """Bitmasks (R, words) uint32, bit t%32 of word t//32 for token t, as (R, width) booleans;
    logits wider than the tokenizer: the extra ids are no tokens at all."""
    bits = (masks[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
    allowed = bits.reshape(masks.shape[0], -1) != 0
    if allowed.shape[1] >= width:
        return allowed[:, :width]
    return mx.concatenate([allowed, mx.zeros((allowed.shape[0], width - allowed.shape[1]), dtype=mx.bool_)], axis=1)


def _init_penalty_state(row: DecodeRow, width: int) -> None:
    if row.counts is not None and row.counts.shape[1] == width:
        return
    row.counts = mx.zeros((1, width), dtype=mx.float32)
    seen = mx.zeros((1, width), dtype=mx.float32)
    ids = [t for t in row.prompt if 0 <= t < width]
    if ids:
        seen[0, mx.array(ids)] = 1.0
    row.seen = seen


class _Early:
    """A constrained batch's masks started before its forward (`Decoder.masks_first`)."""

    __slots__ = ("fed", "done")

    def __init__(self, fed: list[int], done: Any):
        self.fed = fed  # last step's tokens, what each row is fed this step
        self.done = done  # the fill's Future

    def wait(self) -> None:
        """Until the fill is over, whatever it raised (a step that failed before `step`)."""
        with contextlib.suppress(BaseException):
            self.done.result()


class Decoder:
    """Processes and samples a decoding batch's logits; one per generator (`_batch.own_decode`)."""

    def __init__(self, drafter: Any = None, grammar_masks: str = "after") -> None:
        self.grammar_masks = grammar_masks  # `ActorTuning.grammar_masks`, checked there
        self._vocab: int | None = None  # the logits' width, known from the first step
        self._masker: ThreadPoolExecutor | None = None  # 'before': the masks' thread
        self._late_reads: collections.deque[float] = collections.deque(maxlen=AUTO_READS)
        self._since_read = 0  # 'auto': constrained steps since the last read after the forward
        # 'auto': the host's mask work of the last steps that filled after the forward, the waits
        # of the last reads made before it was started, and the steps since 'before' was last
        # turned down for waiting longer than the masks take
        self._mask_times: collections.deque[float] = collections.deque(maxlen=AUTO_READS)
        self._early_reads: collections.deque[float] = collections.deque(maxlen=AUTO_READS)
        self._held_after = 0
        self.early_steps = 0  # constrained steps whose masks were filled beside their forward
        self._plan: _Plan | None = None
        self._executor: Any = None  # llguidance's thread pool, made at the first batch of masks
        # Speculative decoding's drafts (`_drafting.Drafter`), verified by `verify`; None: off.
        self.drafter = drafter
        # wall seconds of the last plain steps, by the batch's width: what a speculative step of
        # that width is judged against
        self.plain_steps: dict[int, collections.deque[float]] = {}
        # speculative steps of each width since its last plain step was timed (`wants_plain`)
        self.speculated: collections.Counter[int] = collections.Counter()
        self.speculated_last = False  # the last step was a speculative one (`_spec_step.py`)

    def plain_step(self, width: int) -> float | None:
        """A plain step of a batch of `width` rows, in seconds (the median of the last ones),
        None before any."""
        steps = sorted(self.plain_steps.get(width, ()))
        return steps[len(steps) // 2] if steps else None

    def timed_plain(self, width: int, seconds: float) -> None:
        """A pipelined plain step of a batch of `width` rows took `seconds`."""
        if (steps := self.plain_steps.get(width)) is None:
            steps = self.plain_steps[width] = collections.deque(maxlen=PLAIN_TIMES)
        steps.append(seconds)
        self.speculated[width] = 0

    def wants_plain(self, width: int) -> bool:
        """Whether a batch of `width` rows should take a plain step, not a speculative one,
        to time it: speculative steps are judged against plain ones of their width, and a
        row that always has drafts (a draft model's) would otherwise never give one, so its
        steps would be judged by acceptance alone however slow they were. Also every
        `PLAIN_REFRESH` speculative steps, since a step's cost moves as the KV grows. (The
        first plain step after a speculative one is not timed, so this asks for two.)"""
        return width not in self.plain_steps or self.speculated[width] >= PLAIN_REFRESH

    def masks_first(self, rows: Sequence[DecodeRow], inputs: Any, first: bool) -> _Early | None:
        """Once the forward of `inputs` is built, before it is started: for a batch with
        grammar rows, when `grammar_masks` says so, read `inputs` (last step's tokens) now and
        start filling the rows' masks in the decoder's thread, which `step` joins after
        starting the forward (the module docstring says when this pays). None: the masks are
        left to `step`. A caller that fails before `step` must `wait` for the fill."""
        if self.grammar_masks == "after" or self._vocab is None:
            return None
        plan = self._plan_for(rows, self._vocab)
        if not plan.grammar:
            return None
        if self.grammar_masks == "auto":
            if len(plan.grammar) < AUTO_ROWS:
                return None
            self._since_read += 1
            reads = self._late_reads
            if not reads or self._since_read > AUTO_RECHECK or statistics.median(reads) >= AUTO_WAIT:
                return None  # `step` reads after the forward, and times the read and the masks
            if self._waits_past_masks():
                return None
        t0 = time.perf_counter()
        fed: list[int] = inputs.tolist()  # type: ignore[assignment]
        if self.grammar_masks == "auto":
            self._early_reads.append(time.perf_counter() - t0)
        if self._masker is None:
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="trio-mlx-masks")
        self.early_steps += 1
        return _Early(fed, self._masker.submit(self._fill_masks, plan, None if first else fed))

    def _waits_past_masks(self) -> bool:
        """'auto': whether reading last step's tokens before the forward is started waited
        longer (the median of the last reads) than the masks take the host, so that 'before'
        would lose more than it hides; every `AUTO_RECHECK` steps so turned down, one goes
        'before' to time the read again."""
        early, masks = self._early_reads, self._mask_times
        if len(early) < AUTO_READS or not masks or statistics.median(early) < statistics.median(masks):
            self._held_after = 0
            return False
        self._held_after += 1
        if self._held_after > AUTO_RECHECK:
            self._held_after = 0
            return False
        return True

    def step(self, logits: Any, rows: Sequence[DecodeRow], inputs: Any, first: bool,
             early: _Early | None = None) -> tuple[Any, list[int]]:
        """Sample every row's next token from `logits` (B, V), the forward of `inputs` (B,):
        what each row was fed this step (the token sampled for it last step, or at its
        `first` step its prompt's last token). Returns the sampled tokens (lazy, computing)
        and `inputs` read back to the host; each row that asks for logprobs has them for
        its token in `inputs` in `row.out`. `early`: the masks `masks_first` started."""
        plan = self._plan_for(rows, logits.shape[-1])
        self._vocab = plan.width
        asked = [(r, r.pending) for i in plan.logprobs if (r := plan.rows[i]).pending is not None]
        fed: list[int] | None = None
        masks = None
        if early is not None:
            try:
                mx.async_eval(logits)
            finally:
                early.wait()
            early.done.result()  # what the fill raised, raised here as `_masks` would
            fed = early.fed
            masks = self._mask_array(plan)
        elif plan.grammar:
            mx.async_eval(logits)  # the device runs the forward while the host fills the masks
            t0 = time.perf_counter()
            fed = inputs.tolist()  # type: ignore[assignment]
            assert fed is not None
            if self.grammar_masks == "auto":
                self._late_reads.append(time.perf_counter() - t0)
                self._since_read = 0
                t0 = time.perf_counter()
            masks = self._masks(plan, None if first else fed)
            if self.grammar_masks == "auto":
                self._mask_times.append(time.perf_counter() - t0)
        sampled, outputs = self._sample(plan, logits, masks)
        mx.async_eval(sampled, *outputs)
        if fed is None:
            fed = inputs.tolist()  # type: ignore[assignment]
            assert fed is not None
        for r, pending in asked:
            assert pending is not None
            lp, i = pending
            r.out = lp.read(i, r.sampling.top_logprobs)
        for i in plan.seeded:
            plan.rows[i].steps += 1
        return sampled, fed

    def spec_masks(self, row: DecodeRow, width: int, fed: list[int], k: int) -> tuple[Any, int]:
        """A constrained row's masks for the positions of its speculative step, before `verify`:
        `fed` is its input to the step (its pending token, its `k` drafts, filler). Position 0
        is the step the row would take without speculation (its matcher fed the pending
        token); positions 1.. follow the drafts as far as the grammar allows them
        (`GrammarProcessor.draft`). Returns the masks (len(fed), words) on the device, and
        how many drafts they cover: the step keeps no more, and `GrammarProcessor.keep`
        must follow with how many it kept. Positions past those repeat the last mask (never
        kept)."""
        g = row.grammar
        assert g is not None
        plan = self._plan_for([row], width)  # binds the row's mask to its plan's bitmask
        assert plan.bitmask is not None
        if g.begin(fed[0]):
            g.fill()
            g.complete()
        out = g.new_bitmask(len(fed))
        out[0] = plan.bitmask[0]
        taken = g.draft(fed[1 : 1 + k], out)
        out[taken + 1 :] = out[taken]
        return mx.array(out.view(np.uint32)), taken

    def verify(self, logits: Any, row: DecodeRow, drafts: Any, masks: Any = None) -> tuple[Any, _Logprobs | None]:
        """The target's own token at each position of a row's speculative step: `logits`
        (K+1, V) are the forward of the row's pending token and the K `drafts` after it
        (`_speculate.py`: the drafts the target keeps are those equal to these tokens).
        Position i is processed as a plain step would process it after the first i drafts:
        the same bias, the penalties counting those drafts, the same filters and temperature;
        a seeded row draws position i from its key for the token it would be (its step
        count plus i). Returns the tokens (lazy, started) and, for a row that asks for
        logprobs, theirs; the row's logprobs of its pending token are read into `row.out`.
        A constrained row's `masks` (from `spec_masks`) forbid at each position what its
        grammar forbids there, after the penalties, as a plain step's mask does. A batch's
        rows are verified one at a time, each with a plan of its own; `settle` goes back
        to each row's."""
        width = logits.shape[-1]
        plan = self._plan_for([row], width)
        pending = row.pending
        n = logits.shape[0]
        x = logits.astype(mx.float32)
        if plan.bias is not None:
            _, ids, vals = plan.bias
            x = x + mx.zeros((width,), dtype=mx.float32).at[ids].add(vals)
        if plan.penalized:
            drafted = (drafts[:, None] == mx.arange(width)[None]).astype(mx.float32)
            before = mx.concatenate([mx.zeros((1, width), dtype=mx.float32), mx.cumsum(drafted, axis=0)])
            counts = plan.counts + before
            seen = mx.maximum(plan.seen, mx.minimum(before, 1.0))
            x = mx.where(seen > 0, mx.where(x < 0, x * plan.rep, x / plan.rep), x)
            x = x - plan.freq * counts - plan.pres * (counts > 0)
        if masks is not None:
            x = mx.where(_allowed(masks, width), x, -mx.inf)
        if plan.all_greedy:
            sampled = mx.argmax(x, axis=-1)
        else:
            noise = None
            if plan.seeded:
                seed = row.sampling.seed
                assert seed is not None
                keys = [((k := _mix64(seed, row.steps + i)) >> 32, k & 0xFFFFFFFF) for i in range(n)]
                noise = mx.vmap(lambda key: mx.random.gumbel((width,), key=key))(mx.array(keys, dtype=mx.uint32))
            sampled = self._draw(plan, x, noise)
        lp = None
        outputs: list[Any] = []
        if plan.logprobs:
            lp = self._position_logprobs(x, sampled, row.sampling.top_logprobs)
            outputs = lp.arrays()
        mx.async_eval(sampled, *outputs)
        if pending is not None:
            prior, i = pending
            row.out = prior.read(i, row.sampling.top_logprobs)
        return sampled, lp

    def settle(self, row: DecodeRow, tokens: list[int], lp: _Logprobs | None) -> list[Any]:
        """After `verify`: the row took `tokens` (the accepted drafts and the target's token
        after them, which is pending now). Advances its seeded key's count and its penalty
        counts by them, and returns the logprobs of the accepted drafts (for a row that asks:
        positions 0.. of `lp`), the pending token's kept for the next step."""
        plan = self._plan
        assert plan is not None, "settle follows verify"
        plan = self._plan_for([row], plan.width)  # the row's own plan: a batch's verifies each made one
        if plan.seeded:
            row.steps += len(tokens)
        if plan.penalized:
            j = mx.zeros((len(tokens),), dtype=mx.int32)
            ids = mx.array(tokens)
            plan.counts = plan.counts.at[j, ids].add(1.0)
            plan.seen = plan.seen.at[j, ids].maximum(1.0)
        if lp is None:
            return []
        top = row.sampling.top_logprobs
        outs = [lp.read(i, top) for i in range(len(tokens) - 1)]
        row.pending = (lp, len(tokens) - 1)
        return outs

    def read_ahead(self, rows: Sequence[DecodeRow]) -> None:
        """Read the logprobs of the tokens last sampled for `rows` now (`_batch.first_tokens`)."""
        for r in rows:
            if r.pending is not None:
                lp, i = r.pending
                r.out = lp.read(i, r.sampling.top_logprobs)

    def _plan_for(self, rows: Sequence[DecodeRow], width: int) -> _Plan:
        plan = self._plan
        if plan is not None and plan.width == width and len(plan.key) == len(rows) and all(
                r.serial == s for r, s in zip(rows, plan.key, strict=True)):
            return plan
        if plan is not None:
            plan.write_back()
        self._plan = plan = _Plan(rows, width)
        return plan

    # -- the host side: grammar masks ---------------------------------------------

    def _masks(self, plan: _Plan, fed: list[int] | None) -> Any:
        self._fill_masks(plan, fed)
        return self._mask_array(plan)

    @staticmethod
    def _mask_array(plan: _Plan) -> Any:
        return plan.masks  # filled in place (`_Plan`): the device reads the host's writes

    def _fill_masks(self, plan: _Plan, fed: list[int] | None) -> None:
        """Advance each grammar row's matcher by the token it was fed and fill its mask (a row
        of `plan.bitmask`); the matchers that need llguidance's full mask fill in one batch.
        No MLX (it may run in the decoder's masks thread)."""
        plan.next_masks()
        fill: list[tuple[Any, int]] = []
        grammars: list[Any] = [plan.rows[i].grammar for i in plan.grammar]
        rows = plan.rows
        tokens = [None if fed is None or rows[i].fresh else fed[i] for i in plan.grammar]
        consumed = self._consume_many(grammars, tokens)
        for j, (g, token) in enumerate(zip(grammars, tokens, strict=True)):
            if g.begin(token) if j not in consumed else g.begin(token, consumed[j]):
                fill.append((g, j))
        if fill:
            assert plan.bitmask is not None
            if len(fill) == 1:
                fill[0][0].fill()
            else:
                self._fill_many(fill, plan.bitmask)
            for g, _ in fill:
                g.complete()

    def _consume_many(self, grammars: list[Any], tokens: list[int | None]) -> dict[int, bool]:
        """Feed each grammar row's matcher its token in one llguidance batch (its threads, the
        GIL released: a consume costs up to a mask's computation, ~70 us inside a long string
        on a 128k vocabulary); {row: whether the matcher took it}, for the rows fed. A failed
        batch (never seen: llguidance keeps a matcher's own failures inside it) ends its rows."""
        if len(grammars) < 2:
            return {}  # one row: its own consume, without a pool's round trip
        feed = [j for j, (g, t) in enumerate(zip(grammars, tokens, strict=True)) if g.consumes(t)]
        feed.sort(key=lambda j: grammars[j].lexer)  # see `_fill_many`
        if len(feed) < 2:
            return {}
        try:
            ok = self._pool().consume_token_par([(grammars[j].matcher, tokens[j]) for j in feed])
        except BaseException as exc:  # a Rust panic is a BaseException: the rows fail, not the batch's step
            if not (isinstance(exc, Exception) or is_panic(exc)):
                raise
            for j in feed:
                grammars[j].fail(exc)
            return dict.fromkeys(feed, False)
        return dict(zip(feed, ok, strict=True))

    def _fill_many(self, fill: list[tuple[Any, int]], bitmask: np.ndarray) -> None:
        """llguidance's batch fill of the rows' masks (its threads, the GIL released). The rows
        that measure their budget this step do so after it (`complete`): a measurement's
        validations take its row's lexer lock, which the fill holds while it fills that
        lexer's rows, and llguidance validates with the GIL held, so a measurement beside
        the fill waited for it with the GIL that the forward's encoding needs."""
        import llguidance.numpy as llnp

        # The pool splits the list into runs: rows that share a lexer (copies of one start,
        # `_constrain.LEXERS`) wait on each other, so each run holds one lexer's rows.
        fill.sort(key=lambda f: f[0].lexer)
        llnp.fill_next_token_bitmask_par(self._pool(), [(g.matcher, j) for g, j in fill], bitmask)

    def _pool(self) -> Any:
        """llguidance's thread pool for the batch's masks and consumes, made at first use."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=_constrain.POOL_THREADS)
        return self._executor

    # -- the device side: one graph for the batch ---------------------------------

    def _sample(self, plan: _Plan, logits: Any, masks: Any) -> tuple[Any, list[Any]]:
        """(the sampled tokens, the other arrays to compute with them)."""
        outputs: list[Any] = []
        plain = (plan.all_greedy and plan.bias is None and not plan.penalized and masks is None
                 and not plan.logprobs)
        if plain:
            return mx.argmax(logits, axis=-1), outputs
        x = logits.astype(mx.float32)
        if plan.bias is not None:
            rows, ids, vals = plan.bias
            x = x.at[rows, ids].add(vals)
        if plan.penalized:
            idx = plan.pen_idx
            sub = x[idx]
            sub = mx.where(plan.seen > 0, mx.where(sub < 0, sub * plan.rep, sub / plan.rep), sub)
            sub = sub - plan.freq * plan.counts - plan.pres * (plan.counts > 0)
            x[idx] = sub
        if masks is not None:
            x[plan.g_idx] = mx.where(_allowed(masks, x.shape[-1]), x[plan.g_idx], -mx.inf)
        greedy_tokens = mx.argmax(x, axis=-1)
        if plan.all_greedy:
            sampled = greedy_tokens
        else:
            sampled = self._draw(plan, x)
            if plan.greedy is not None:
                sampled = mx.where(plan.greedy, greedy_tokens, sampled)
        if plan.penalized:
            j = mx.arange(len(plan.penalized))
            chosen = sampled[plan.pen_idx]
            plan.counts = plan.counts.at[j, chosen].add(1.0)
            plan.seen = plan.seen.at[j, chosen].maximum(1.0)
            outputs += [plan.counts, plan.seen]
        if plan.logprobs:
            outputs += self._logprobs(plan, x, sampled).arrays()
        return sampled, outputs

    def _draw(self, plan: _Plan, x: Any, noise: Any = None) -> Any:
        """Every sampling row's token: filtered, tempered, drawn by Gumbel-max (with `noise`,
        if given, instead of the plan's own)."""
        if plan.sort or plan.use_min_p:
            lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
            threshold = None
            if plan.use_min_p:  # mlx_lm's apply_min_p: p >= min_p * max p
                threshold = mx.max(lp, axis=-1, keepdims=True) + plan.min_p
            if plan.sort:
                ascending = mx.sort(lp, axis=-1)
                # mlx_lm's apply_top_p: drop the tokens with at least top_p of the mass above them
                probs = mx.exp(ascending)
                above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
                total = above[:, :1] + probs[:, :1]
                dropped = (above >= plan.top_p * total).sum(axis=-1, keepdims=True)
                at = mx.maximum(dropped, plan.top_k)  # top-k: keep from the k-th largest up
                cut = mx.take_along_axis(ascending, at, axis=-1)
                threshold = cut if threshold is None else mx.maximum(threshold, cut)
            assert threshold is not None
            x = mx.where(lp >= threshold, x, -mx.inf)
        y = x * plan.inv_temp
        return mx.argmax(y + (self._noise(plan, y.shape) if noise is None else noise), axis=-1)

    def _noise(self, plan: _Plan, shape: tuple[int, ...]) -> Any:
        """Gumbel noise per row: a seeded row's from its own key, the others' from the global PRNG."""
        if not plan.seeded:
            return mx.random.gumbel(shape)
        keys = []
        for i in plan.seeded:
            r = plan.rows[i]
            seed = r.sampling.seed
            assert seed is not None
            k = _mix64(seed, r.steps)
            keys.append((k >> 32, k & 0xFFFFFFFF))  # mx.random.key(k)'s two words
        own = mx.vmap(lambda key: mx.random.gumbel(shape[1:], key=key))(mx.array(keys, dtype=mx.uint32))
        if len(plan.seeded) == shape[0]:
            return own
        noise = mx.random.gumbel(shape) if plan.unseeded else mx.zeros(shape, dtype=mx.float32)
        noise[mx.array(plan.seeded)] = own
        return noise

    @staticmethod
    def _position_logprobs(x: Any, sampled: Any, top: int) -> _Logprobs:
        """Every position's chosen token's log-probability and the top ones (`verify`)."""
        lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lp, sampled[:, None], axis=-1)[:, 0]
        idx = vals = None
        if top:
            idx = mx.argpartition(-lp, kth=top - 1, axis=-1)[:, :top]
            vals = mx.take_along_axis(lp, idx, axis=-1)
        return _Logprobs(chosen, idx, vals)

    def _logprobs(self, plan: _Plan, x: Any, sampled: Any) -> _Logprobs:
        """The chosen token's log-probability and the top ones, for the rows that asked;
        each such row keeps where to find its own (`DecodeRow.pending`)."""
        sub = x[plan.lp_idx]
        lp = sub - mx.logsumexp(sub, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lp, sampled[plan.lp_idx][:, None], axis=-1)[:, 0]
        idx = vals = None
        if plan.top:
            idx = mx.argpartition(-lp, kth=plan.top - 1, axis=-1)[:, : plan.top]
            vals = mx.take_along_axis(lp, idx, axis=-1)
        out = _Logprobs(chosen, idx, vals)
        for j, i in enumerate(plan.logprobs):
            plan.rows[i].pending = (out, j)
        return out
