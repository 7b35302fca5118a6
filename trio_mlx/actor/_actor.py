"""The GPU actor: the one thread that owns the model, the BatchGenerator and every mx.array.

Its whole life is ONE `trio.to_thread.run_sync(actor.run, ...)` call made by
the engine (docs/design.md, rule 1): MLX streams are thread-local, so loading,
warm-up, every insert/next/remove and the final cleanup happen here. Once per
decode step it crosses into trio exactly once (`link.exchange(report)`),
handing over every token of the step and taking back new commands; when the
batch is empty it blocks in `link.wait_commands()` and burns no CPU. The same
actor runs on the main thread of a child process with a pipe for its link
(`_process.py`, `Engine(actor="process")`).

Only `actor/` and `models/` import MLX. Token ids and floats leave the actor; arrays never do.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from .. import _heap as heap
from .. import models
from . import _disk_cache as disk_cache
from . import _streams as streams
from ._admission import Admission, group_bounds
from ._batch import (
    EARLY_FIRST_BESIDE,
    CausalPrefill,
    Decoded,
    batch_rows,
    first_tokens,
    move_whole_groups,
    next_step,
    own_decode,
    plain_kv,
    prompts_left,
    remove_rows,
    select_adapters,
    set_prefill_chunk,
    take_prompt_tokens,
)
from ._constrain import GrammarProcessor, model_vocab
from ._decode import Decoder, DecodeRow
from ._drafting import Drafter
from ._link import ActorLink
from ._loading import kv_quantization, load_drafter
from ._memory import IDLE_RELEASE, apply_cache_limit, memory_figures, prefill_budget
from ._prompt_cache import PromptCache, budget
from ._protocol import (
    Abort,
    ActorConfig,
    ActorInfo,
    Command,
    FinishReason,
    SamplingParams,
    Shutdown,
    StepReport,
    Submit,
    TokenOut,
)
from ._rank import Rank
from ._reuse import Reuse
from ._row_adapters import RowAdapters
from ._sampling import SamplerCache, add_logprobs, make_processors
from ._schedule import Schedule, Seq
from ._shapes import (
    GRID_PREFIX,
    budget_chunk,
    prefill_chunk,
    prefill_grid,
)
from ._trace import StepTrace
from ._warmup import WARMUP_PROMPT, prebuild_cuda, rehearse, warm_up

log = logging.getLogger("trio_mlx.actor")  # stages of startup; from any thread, through logging

# MLX memory figures ride along with one step report in this many, and with
# the report of a step that leaves the batch empty (so an idle server's figures
# are current); the number is arbitrary, small enough for a scrape to see it move.
_MEMORY_EVERY = 64
# How long one prefill step of a group entering an idle batch may be expected to take, on a
# device with a prefill budget (the CPU by default), before the actor cuts it into chunks
# within the budget: each chunk is a step, and each step's report is the progress the
# engine's watchdog looks for (`/health` says "stalled" after `watchdog_seconds`, 30 s by
# default, without one). Eight ~1.9k-token prompts into an idle CPU server were one step of
# ~160 s, and /health answered "stalled" from 30 s on. Arbitrary: a sixth of the default
# watchdog. Expected from the prompt tokens and the last prefill rate the actor measured.
PROGRESS_SECONDS = 5.0
# Prefill steps with fewer prompt tokens than this do not update the measured rate (their
# time is mostly overhead). Arbitrary.
_RATE_MIN_TOKENS = 64


class Actor:
    """Runs on the GPU thread. Construct on any thread; call `run()` on the GPU thread. `rank`:
    its place in a distributed group (`_rank.py`); by default a single device's."""

    def __init__(self, config: ActorConfig, link: ActorLink, rank: Rank | None = None):
        self.config = config
        self.rank = rank if rank is not None else Rank()
        self.thread_id: int | None = None
        self._model: Any = None
        self._bg: BatchGenerator | None = None
        self._context = 0
        self._vocab = 0
        self._heads = 0  # attention heads, for the prefill chunk (`_shapes.prefill_chunk`)
        self._kv: tuple[int, int] | None = None  # (group size, bits) of a quantized KV cache; set in _load
        # The sequence table and the finish, abort and retire rules (`_schedule.py`, shared with
        # the fake actor).
        self.schedule = Schedule(config.tuning.retire_steps)
        self._samplers = SamplerCache()
        # The decode step: the actor's own (`_decode.Decoder`, hooked in by `_batch.own_decode`),
        # or mlx_lm's `GenerationBatch` with per-row samplers and processors ("mlx").
        self._owned = config.tuning.decode_step == "owned"
        self._decoder: Decoder | None = None
        self._gpu = False  # set in run(), once the device is known
        self._grid = False  # prefill on the shape grid (`_batch.CausalPrefill`): on CUDA
        self._budget = 0  # prompt tokens a prefill step may take while rows decode (0: no bound); set in run()
        self._prefill_rate: float | None = None  # prompt tokens per second, last measured (`PROGRESS_SECONDS`)
        self._idle_release: float | None = None  # likewise
        self._rows, tokens = group_bounds(config.tuning.prefill_batch, config.tuning.prefill_step, config.tuning.max_batch)
        self._admission = Admission(config.tuning.admit_window, config.tuning.prefill_batch, self._rows, tokens, config.tuning.max_batch)
        self._inserted = 0  # sequences inserted by the last _apply (for the step trace)
        self._failed_rows: list[tuple[int, str]] = []  # rows a grammar processor failed this step
        self._settled = 0.0  # seconds the last settle waited for the device (the trace)
        self._dry: list[int] = []  # a dry batch's rows, stored and gone once its step's report is over (`settle`)
        self._reuse = Reuse(PromptCache(0))  # the prompt cache, off until warm (`_open_cache`)
        self._cached: list[tuple[int, int]] = []  # (rid, prompt tokens from the cache) this step
        self._spec_counts: list[tuple[int, int, int]] = []  # (rid, drafted, kept) this step (`_speculated`)
        self._drafter: Drafter | None = None  # speculative decoding's drafts (`_drafting.py`); set in _load
        # Each row's named LoRA adapter (`ActorTuning.adapters`, `_row_adapters.RowAdapters`); None without.
        self._adapters: RowAdapters | None = None
        self._link = self.rank.bind(self, link)  # last: the rank may read the actor's admission

    # -- lifecycle -------------------------------------------------------------

    def run(self) -> None:
        """The actor's whole life. Raises if the model cannot be loaded."""
        streams.begin()  # first: a group's greeting in `life` runs on the generation stream too
        try:
            with self.rank.life():
                try:
                    self.start()
                    self.rank.loop()
                    self._save_disk()  # a clean stop (Shutdown): keep the cache's newest entries
                finally:
                    with self.rank.stage("stopping"):
                        self._free()
        finally:
            streams.end()

    def start(self) -> None:
        """Load, warm up, hand `ActorInfo` over (then a host calls `turn`s and `stop`: `_host.py`)."""
        self.thread_id = threading.get_ident()
        t0 = time.perf_counter()
        self._hook("load")
        log.info("loading the weights on %s", mx.default_device())
        config = self._load()
        t1 = time.perf_counter()
        log.info("loaded %s (%.1f MB of weights) in %.2f s; decode step: %s", config.get("model_type", "the model"),
                 mx.get_active_memory() / 1e6, t1 - t0, self.config.tuning.decode_step)
        if self.config.tuning.warmup:
            log.info("warming up (%s)", "every prefill group size, then a rehearsal" if self._gpu
                     else "one short prompt")
            self._warmup()
            log.info("warm-up done in %.2f s", time.perf_counter() - t1)
        self._open_cache()
        self._load_disk()
        heap.freeze()  # what startup loaded leaves the collector's walks (`_heap.py`)
        info = ActorInfo(
            model_type=str(config.get("model_type", "unknown")),
            context_length=self._context,
            vocab_size=int(config.get("vocab_size", 0)),
            thread_id=self.thread_id,
            device=str(mx.default_device()),
            load_seconds=time.perf_counter() - t0,
            pid=os.getpid(),
            prompt_cache_bytes=self._reuse.cache.max_bytes,
            blas="" if self._gpu else models.cpu_blas_status().description,
        )
        self._link.ready(info)

    def stop(self, clean: bool) -> None:
        """Free every array (`run`'s last part); after a Shutdown (`clean`), save the prompt cache first."""
        try:
            if clean:
                self._save_disk()
        finally:
            self._free()

    def due(self, now: float) -> float | None:
        """For a host: 0 with work and no command, else seconds until held arrivals enter, or None."""
        if self.rank.busy():
            return 0.0
        admission = self.rank.arrivals()
        return admission.hold(now) if admission.pending else None

    def turn(self, commands: Sequence[Command]) -> StepReport | None:
        """One hosted turn: apply the commands the host took from the link, run the step; None at Shutdown."""
        self._hook("loop")
        return self.rank.turn(commands)

    def _load(self) -> dict[str, Any]:
        """Load the model and make the generator; returns the model's config."""
        apply_cache_limit(self.config.tuning.cache_limit_gb)
        self._model, config = self.rank.load_weights()
        selector = models.adapter_rows(self._model)
        self._adapters = None if selector is None else RowAdapters(selector)
        self._context = models.context_length(config)
        self._vocab = int(config.get("vocab_size", 0))
        self._heads = int(config.get("num_attention_heads") or config.get("n_heads") or 0)
        self._gpu = gpu = mx.default_device().type == mx.DeviceType.gpu
        self._kv = kv_quantization(self._model, config, self.config.tuning)
        # the grid's shapes are those of the fused attention, which quantized KV never takes
        self._grid = prefill_grid() and plain_kv(self._model) and self._kv is None
        self._budget = prefill_budget(self.config.tuning.prefill_budget)
        self._drafter = load_drafter(self._model, self.config.tuning, self.config.draft_model_path, self._vocab)
        self._bg = self._new_generator()
        release = self.config.tuning.idle_release
        self._idle_release = (IDLE_RELEASE if gpu else 0.0) if release is None else release
        return config

    def _open_cache(self) -> None:
        """A fresh, empty prompt cache (`_prompt_cache.py`, or the rank's): once warm, and for
        the warm-up's rehearsal (which drops its own after)."""
        if (reuse := self.rank.open_cache()) is not None:
            self._reuse = reuse
            return
        limit, pressure = budget(self.config.tuning.prompt_cache_gb, self.config.prompt_cache_share)
        if limit and not plain_kv(self._model):
            limit = 0  # its cache cannot be cut back to a prefix: no reuse (`_batch.plain_kv`)
        self._reuse = Reuse(PromptCache(limit, pressure))

    def _disk_folder(self) -> Path | None:
        """Where the prompt cache's disk tier keeps this model's entries; None when off."""
        c = self.config
        if not (self.rank.disk and c.prompt_cache_disk and c.tuning.prompt_cache_disk_gb and self._reuse.cache.enabled):
            return None
        adapter = c.tuning.adapter_path
        return disk_cache.folder(Path(c.prompt_cache_disk), Path(c.model_path), Path(adapter) if adapter else None,
                                 self._kv)

    def _load_disk(self) -> None:
        if (where := self._disk_folder()) is not None:
            disk_cache.read_in(self._reuse.cache, where, len(self._model.layers), self._kv)

    def _save_disk(self) -> None:
        if (where := self._disk_folder()) is not None:
            disk_cache.write_out(self._reuse.cache, where, int(self.config.tuning.prompt_cache_disk_gb * 1e9))

    def _hook(self, stage: str) -> None:
        if self.config.fault_hook is not None:
            self.config.fault_hook(stage)

    def _new_generator(self) -> BatchGenerator:
        bg = BatchGenerator(
            CausalPrefill(self._model, self._grid, self._link and self._link.built, self._heads, self._kv,  # type: ignore[arg-type]  # called and read as the model
                          self._adapters),
            max_tokens=1,
            completion_batch_size=self.config.tuning.max_batch,
            prefill_batch_size=self._rows,  # a group of short prompts enters whole (`Admission`)
            prefill_step_size=self.config.tuning.prefill_step,
            stream=streams.generation(),  # made on this thread (`_streams.py`)
        )
        move_whole_groups(bg)
        if self._adapters is not None:
            self._adapters.slots.clear()  # a fresh generator: no row of the old one is left
            select_adapters(bg)
        if self._owned:
            self._decoder = Decoder(self._drafter, self.config.tuning.grammar_masks)
            own_decode(bg, self._decoder)
        return bg

    def _warmup(self) -> None:
        """Visit before ready what live traffic would make MLX compile (`_warmup.py`): every prefill
        group size; on CUDA the grid's prefills and padded decode steps; on a GPU a rehearsal."""
        with self.rank.stage("warming up", startup=True):
            self._warm()

    def _warm(self) -> None:
        assert self._bg is not None
        gpu = self._gpu
        length = max(1, min(WARMUP_PROMPT if gpu else 4, self._context // 2 - 4))
        token = 1 if self._vocab > 1 else 0
        warm_up(self._bg, token, length, self._rows if gpu else 1,
                (lambda: DecodeRow(SamplingParams(temperature=0.0))) if self._owned else None)
        if prefill_grid():  # on CUDA
            t0 = time.perf_counter()
            with mx.stream(self._bg.stream):
                ran = prebuild_cuda(self._model, token, self._context, self.config.tuning, self._drafter, self._grid)
            log.info("ran %d prefill shapes of the grid, padded decode steps and matmuls, in %.2f s", ran,
                     time.perf_counter() - t0)
        if gpu and self._context >= length + 16:  # room for the rehearsal's 12 tokens
            rehearse(self, token, length)
        self._reset_batch()
        self.schedule.steps = 0

    def _free(self) -> None:
        """Drop every array on this thread and synchronize, so the process exits cleanly."""
        self.schedule.clear()
        self._admission.pending.clear()
        self._samplers.clear()
        self._reuse.reset(failed=True)
        try:
            if self._bg is not None:
                self._bg.close()
        finally:
            self._bg = None
            self._decoder = None  # its plan holds the batch's per-row arrays
            self._drafter = None  # the draft model's weights
            self._model = None
            heap.thaw()  # the model's cycles, frozen at startup, can go now
            gc.collect()
            mx.synchronize()
            mx.clear_cache()

    # -- the loop --------------------------------------------------------------

    def _loop(self) -> None:
        # The exchange waits for the loop to have taken the last report in (rule 2): a
        # fire-and-forget handover, with nothing bounding how far the actor runs ahead, was
        # measured and lost (the event loop starves at high concurrency and TTFT grows).
        report, link = StepReport(), self._link
        trace_path = self.config.tuning.step_trace
        trace = StepTrace(trace_path) if trace_path else None
        clock = time.perf_counter
        try:
            while True:
                link.check()
                self._hook("loop")  # outside the step's recovery: a fault here kills the actor
                t0 = clock()
                commands = self._next_commands(report, trace)
                t1 = clock()
                turn = self.rank.turn(commands)
                if turn is None:
                    return  # Shutdown
                report = turn
                if trace is not None:
                    trace.write(t1, t1 - t0, report, self._inserted, len(self.schedule.retired),
                                batch_rows(self._bg), self._settled)
                    self._settled = 0.0
        finally:
            if trace is not None:
                trace.close()

    def _next_commands(self, report: StepReport, trace: StepTrace | None = None) -> list[Command]:
        """Hand the last step's report over and take the commands (then `settle` what a
        dry step left); with no work, wait for more: blocked while idle, or asleep while
        admission holds arrivals for company (sleep, not spin)."""
        link, admission = self._link, self.rank.arrivals()
        commands = link.exchange(report)
        t0 = time.perf_counter()
        if (settled := self.settle(link)) is not None:
            if trace is not None:
                trace.settle_row(t0, time.perf_counter() - t0, settled.live, batch_rows(self._bg), self._settled)
            self._settled = 0.0
            if not commands:  # the idle figures, current
                commands = link.exchange(settled)
        if not commands and not self.rank.busy():
            link.built()  # no step to build: a report held for one goes over now
            if not admission.pending:
                commands = self._idle()
            elif hold := admission.hold(time.perf_counter()):
                commands = link.wait_commands(hold)
        return commands

    def _idle(self) -> list[Command]:
        """Nothing to do: block for commands, handing MLX's buffer cache back if
        they take longer than the idle release.

        MLX keeps freed buffers for reuse and never gives them back by itself:
        a bench process that loaded a 1B model beside a server that had just
        served 256 streams ran out of H100 memory. Other processes share that
        memory, and on Apple silicon the whole system does, so an idle server
        gives it back; a busy one never waits this long between steps.
        """
        link, release = self._link, self._idle_release
        if not release:
            return link.wait_commands()
        commands = link.wait_commands(release)
        if commands:
            return commands
        mx.clear_cache()
        commands = link.exchange(StepReport(memory=memory_figures()))  # the engine's figures, current
        return commands or link.wait_commands()

    def _apply(self, commands: Sequence[Command]) -> list[tuple[int, str]] | None:
        """Apply this step's commands; returns inserts that failed, or None on Shutdown."""
        self.settle()  # rows a dry step left go before any other change (a no-op if settled)
        admission, schedule = self._admission, self.schedule
        now = time.perf_counter()
        removes: list[int] = []
        for cmd in commands:
            match cmd:
                case Submit():
                    admission.add(cmd, now)
                    self._reuse.arrived(cmd)
                case Abort(rid=rid):
                    if admission.drop(rid) or self._reuse.drop(rid):
                        continue
                    if seq := schedule.abort(rid):
                        if seq.stage != "decode":
                            admission.readmit(self._reuse.left(rid), now)  # waited for its prefill
                        removes.append(seq.uid)
                case Shutdown():
                    return None
        assert self._bg is not None
        subs = admission.due(now, schedule.decoding, schedule.prefilling)
        aborted = bool(removes)
        # A lone live row speculates only once finished rows are out of its batch (`_drafting.py`).
        lone = self._drafter is not None and len(schedule.seqs) == schedule.decoding == 1
        removes.extend(schedule.leaving(bool(removes or subs) or lone))
        if removes:
            self._reuse.leaving(self._bg, removes)  # finished rows' KV, before it goes
            remove_rows(self._bg, removes)
            self._forget(removes)
            if aborted:
                self._hook("removed")
        subs = self._reuse.split(subs)  # after the removals: they may have stored what subs share
        subs, later = self._reuse.even(subs, self.config.tuning.prefill_step)
        admission.readmit(later, now)
        subs, grammars, failed = self._grammars(subs)
        subs, grammars, failed = self._known_adapters(subs, grammars, failed)
        for rid, _ in failed:  # what waited for a row that never entered goes back to admission
            admission.readmit(self._reuse.left(rid), now)
        self._inserted = len(subs)
        if not subs:
            return failed
        caches, cached_ids, cached = self._reuse.lookup(subs, GRID_PREFIX if self._grid else 1)
        try:
            uids = self._bg.insert(
                [list(s.prompt[n:]) for s, n in zip(subs, cached, strict=True)],
                max_tokens=[s.max_tokens + schedule.slack(len(s.prompt), s.max_tokens, self._context) for s in subs],
                caches=caches,
                all_tokens=cached_ids,
                **self._row_sampling(subs, grammars),
            )
        except Exception as exc:  # bad input that slipped past validation
            for s in subs:
                admission.readmit(self._reuse.left(s.rid), now)
            return failed + [(s.rid, f"insert failed: {exc}") for s in subs]
        for s, uid, n, g in zip(subs, uids, cached, grammars, strict=True):
            schedule.enter(Seq.of(s, uid, g))
            if s.adapter is not None and self._adapters is not None:
                self._adapters.slots[uid] = self._adapters.selector.slot(s.adapter)
            if n:
                self._cached.append((s.rid, n))
        return failed

    def _known_adapters(
        self, subs: list[Submit], grammars: list[GrammarProcessor | None], failed: list[tuple[int, str]]
    ) -> tuple[list[Submit], list[GrammarProcessor | None], list[tuple[int, str]]]:
        """The arrivals whose adapter this model has (the engine checks names first: this
        guards the actor's own contract), and a failure for each of the others."""
        names = self._adapters.selector.names if self._adapters is not None else ()
        if all(s.adapter is None or s.adapter in names for s in subs):
            return subs, grammars, failed
        kept = [(s, g) for s, g in zip(subs, grammars, strict=True) if s.adapter is None or s.adapter in names]
        failed = failed + [(s.rid, f"no adapter named {s.adapter!r} is loaded")
                           for s in subs if s.adapter is not None and s.adapter not in names]
        return [s for s, _ in kept], [g for _, g in kept], failed

    def _forget(self, uids: list[int]) -> None:
        """Rows that left the batch: their adapters go from the table."""
        if self._adapters is not None:
            self._adapters.forget(uids)

    def _row_sampling(self, subs: list[Submit], grammars: list[GrammarProcessor | None]) -> dict[str, Any]:
        """`BatchGenerator.insert`'s samplers and logits processors for `subs`: for the owned
        decode step a `DecodeRow` each (`_decode.py`), for mlx_lm's its own per-row kind."""
        if self._owned:
            return {"samplers": [DecodeRow(s.sampling, s.prompt, g, s.max_tokens, s.stop_token_ids)
                                 for s, g in zip(subs, grammars, strict=True)]}
        return {
            "samplers": [self._samplers.get(s.sampling) for s in subs],
            "logits_processors": [
                make_processors(s.sampling, len(s.prompt), self._context) + ([g] if g else [])
                for s, g in zip(subs, grammars, strict=True)
            ],
        }

    def _grammars(
        self, subs: list[Submit]
    ) -> tuple[list[Submit], list[GrammarProcessor | None], list[tuple[int, str]]]:
        """Each constrained arrival's grammar processor, built here on the actor thread (its
        matcher is llguidance state the row's steps use); one that fails fails its row only."""
        if not any(s.grammar for s in subs):
            return subs, [None] * len(subs), []
        kept: list[Submit] = []
        grammars: list[GrammarProcessor | None] = []
        failed: list[tuple[int, str]] = []
        for s in subs:
            try:
                g = None if s.grammar is None else GrammarProcessor(
                    model_vocab(self.config.model_path), s.grammar.source, s.max_tokens)
            except Exception as exc:
                failed.append((s.rid, f"the grammar could not be set up: {type(exc).__name__}: {exc}"))
                continue
            kept.append(s)
            grammars.append(g)
        return kept, grammars, failed

    def _step(self, failed: list[tuple[int, str]]) -> StepReport:
        schedule = self.schedule
        if not schedule.seqs:
            self._link.built()  # likewise; the cache's figures beside the memory that counts them
            return StepReport(failed=tuple(failed), live=len(self._admission.pending), memory=memory_figures(),
                              prompt_cache=self._reuse.stats())  # (`settle`'s report may have stayed)
        assert self._bg is not None
        t0 = time.perf_counter()
        try:
            self._hook("step")
            if schedule.prefilling:
                self._cut_prefill()
            prompt_responses, generation_responses = next_step(self._bg)
            tokens = self._tokens(generation_responses)
        except Exception as exc:
            return self.rank.recover(exc, failed)
        narrow = schedule.decoding <= EARLY_FIRST_BESIDE  # live rows beside those that start now
        if self._failed_rows:
            failed = failed + self._failed_rows
            self._failed_rows = []
        if dry := schedule.dry():  # the batch ran dry: nothing left to overlap
            if self.rank.settles_after_handover:  # their KV stored and copied in `settle`
                self._dry = dry
            else:
                self._reuse.leaving(self._bg, dry)
                remove_rows(self._bg, dry)
                self._forget(dry)
        prefilling, decoding, prompt_tokens = [], [], 0
        prefilled: list[tuple[int, int, int]] = []
        for pr in prompt_responses:
            seq = schedule.by_uid.get(pr.uid)
            if seq is None:
                continue
            if schedule.started(seq):
                prefilling.append(seq.rid)
            if pr.end_of_prompt and schedule.decodes(seq):
                decoding.append(seq.rid)
                prefilled.append((seq.rid, seq.uid, seq.prompt_len))
        if prefilled:
            self._admission.readmit(self._reuse.prefilled(self._bg, prefilled), time.perf_counter())
        first: tuple[TokenOut, ...] = ()  # read now: a narrow batch's (`_first_tokens`)
        if prefilled and narrow:
            try:
                tokens += (first := self._first_tokens([uid for _, uid, _ in prefilled]))
            except Exception as exc:
                return self.rank.recover(exc, failed)
        prompt_tokens = take_prompt_tokens(self._bg)
        self._measure_prefill(prompt_tokens, time.perf_counter() - t0)
        schedule.steps += 1
        memory: tuple[int, int, int] | None = None
        if not schedule.seqs:
            if not self._dry:  # else `settle` reads them, once the rows have left
                memory = self._settled_figures()
        elif schedule.steps % _MEMORY_EVERY == 1:
            memory = memory_figures()
        cached, self._cached = tuple(self._cached), []
        speculated, self._spec_counts = tuple(self._spec_counts), []
        return StepReport(
            memory=memory,
            tokens=tokens,
            prefilling=tuple(prefilling),
            decoding=tuple(decoding),
            failed=tuple(failed),
            prompt_tokens=prompt_tokens,
            step_seconds=time.perf_counter() - t0,
            live=len(schedule.seqs) + len(self._admission.pending) + self._reuse.parked,
            cached=cached,
            prompt_cache=self._reuse.stats(),
            speculated=speculated, first=bool(first),
        )

    def _settled_figures(self) -> tuple[int, int, int]:
        """MLX's memory figures, which stand while idle, once the device ran the batch's queued work
        (KV copies, removal), or they count buffers it frees (the soak test saw 1.3 MB): `settle_s`."""
        assert self._bg is not None
        t0 = time.perf_counter()
        mx.synchronize(self._bg.stream)
        self._settled = time.perf_counter() - t0
        return memory_figures()

    def settle(self, link: ActorLink | None = None) -> StepReport | None:
        """After the report of a step that emptied the batch (`Rank.settles_after_handover`): the
        finished rows' KV is copied into the prompt cache (building the copies takes the host time
        in every row and layer), the rows leave, the device settles: their last tokens wait for
        none of it (docs/design.md, "Retirement"). Returns the idle figures' report, or None."""
        dry, self._dry = self._dry, []
        if not dry or self._bg is None:
            return None
        if link is not None:
            link.built()  # the report it holds for the next graph goes over first
        self._reuse.leaving(self._bg, dry)
        remove_rows(self._bg, dry)
        self._forget(dry)
        # the figures whole, not `stats()`'s change: a report the loop drops (commands came) leaves
        # the change to the next step's
        return StepReport(memory=self._settled_figures(), prompt_cache=self._reuse.cache.stats(),
                          live=len(self._admission.pending) + self._reuse.parked)

    def _cut_prefill(self) -> None:
        """Cut the next prefill step's chunk: so that its attention scratch fits the prompts
        in the batch (off the shape grid; on it the model does, for the steps that
        materialize scores: `CausalPrefill`), and, while sequences decode, so that it takes
        at most the prompt-token budget (`_budget`, `_shapes.budget_chunk`). mlx_lm's
        `next()` runs the decoding rows' step and then one chunk of each prompt, so a group
        of long prompts cut this way leaves the running streams a token every step
        between its chunks, instead of stopping them for its whole prefill."""
        assert self._bg is not None
        step = self.config.tuning.prefill_step
        if not self._grid:
            prompts = [s.prompt_len for s in self.schedule.seqs.values() if s.stage != "decode"]
            step = prefill_chunk(step, len(prompts), max(prompts), self._heads)
        if self._budget and (self.schedule.decoding or self._long_step(step)):
            step = budget_chunk(step, prompts_left(self._bg), self._budget, self._grid)
        set_prefill_chunk(self._bg, step)

    def _long_step(self, step: int) -> bool:
        """Whether a prefill step in chunks of `step` would take longer than PROGRESS_SECONDS
        at the rate last measured. Before any measurement, a step past the budget is cut
        (its first chunk, within the budget, measures the rate for the rest)."""
        if not self.rank.progress_cut:
            return False
        assert self._bg is not None
        tokens = sum(min(n, step) for n in prompts_left(self._bg))
        rate = self._prefill_rate
        return tokens > self._budget if rate is None else tokens > rate * PROGRESS_SECONDS

    def _measure_prefill(self, prompt_tokens: int, seconds: float) -> None:
        if prompt_tokens >= _RATE_MIN_TOKENS and seconds > 0:
            self._prefill_rate = prompt_tokens / seconds

    def _first_tokens(self, uids: list[int]) -> tuple[TokenOut, ...]:
        """The first tokens of rows that start decoding in a narrow batch, out with the step
        that sampled them.

        mlx_lm reports a row's first token one step after the step that samples it (once
        the next step's graph is built), so a request's time to first token held a whole
        decode step more than its prefill. Read now (`_batch.first_tokens`), the device is
        waited for: the overlap of that computation with building the next step is lost,
        for every row of the batch. So only beside at most `EARLY_FIRST_BESIDE` decoding rows
        (`_batch.py` says why); in a wider batch, and for a constrained row (its grammar's state
        moves with mlx_lm's own step), the next step reports it. The next step reports these
        tokens again: `_tokens` skips them (`Seq.ahead`)."""
        by_uid = self.schedule.by_uid
        rows = [uid for uid in uids if (seq := by_uid.get(uid)) is not None and seq.grammar is None]
        if not rows:
            return ()
        assert self._bg is not None
        out = self._tokens(first_tokens(self._bg, rows))
        for uid in rows:
            if (seq := by_uid.get(uid)) is not None:  # not ended by its first token
                seq.ahead = True
        return out

    def _tokens(self, responses: Sequence[Any] | Decoded) -> tuple[TokenOut, ...]:
        if isinstance(responses, Decoded):
            return self._decoded(responses)
        out: list[TokenOut] = []
        want_logprobs: list[tuple[int, Any, Seq]] = []
        ended = 0
        schedule = self.schedule
        for r in responses:
            seq = schedule.by_uid.get(r.uid)
            if seq is None:  # a retired row: its tokens are nobody's
                if r.finish_reason is not None and schedule.gone(r.uid):
                    self._reuse.dropped(r.uid, r.prompt_cache, r.all_tokens)  # the generator dropped it itself
                continue
            if seq.ahead:  # its first token, already out (`_first_tokens`)
                seq.ahead = False
                if r.finish_reason is None:  # mlx_lm ends a row by itself only past max_tokens + slack
                    continue
            reason = self._finish(seq, r.token, r.finish_reason)
            if reason is not None:
                ended += 1
                if r.finish_reason is not None:
                    self._reuse.dropped(r.uid, r.prompt_cache, r.all_tokens)
            if reason == "error":
                continue  # reported in the step's `failed`
            if seq.sampling.logprobs:
                want_logprobs.append((len(out), r, seq))
            out.append(TokenOut(seq.rid, r.token, reason))
        if ended:
            self._admission.finished(time.perf_counter(), ended)
        if want_logprobs and self.rank.logprobs:  # a rank that reports tokens
            add_logprobs(out, want_logprobs)
        return tuple(out)

    def _decoded(self, step: Decoded) -> tuple[TokenOut, ...]:
        """`_tokens` for the owned decode step: no row ended by the generator, and the
        logprobs of rows that asked already read (`DecodeRow.out`)."""
        if step.spec is not None:
            return self._speculated(step)
        out: list[TokenOut] = []
        ended = 0
        by_uid = self.schedule.by_uid
        for uid, token, row in zip(step.uids, step.tokens, step.rows, strict=True):
            seq = by_uid.get(uid)
            if seq is None:  # a retired row: its tokens are nobody's
                continue
            if seq.ahead:  # its first token, already out (`_first_tokens`)
                seq.ahead = False
                continue
            reason = self._finish(seq, token, None)
            if reason is not None:
                ended += 1
                if reason == "error":
                    continue  # reported in the step's `failed`
            if seq.sampling.logprobs and row.out is not None:
                logprob, top = row.out
                out.append(TokenOut(seq.rid, token, reason, logprob, top))
            else:
                out.append(TokenOut(seq.rid, token, reason))
        if ended:
            self._admission.finished(time.perf_counter(), ended)
        return tuple(out)

    def _speculated(self, step: Decoded) -> tuple[TokenOut, ...]:
        """`_decoded` for a speculative step (`_spec_step.speculative_step`): a row's token, then
        the drafted tokens the model kept, each through the finish rule in order; the tokens
        after one that ends the sequence are dropped. Each row's drafted and kept counts go
        in the step's report (`StepReport.speculated`)."""
        assert step.spec is not None
        out: list[TokenOut] = []
        ended = 0
        by_uid = self.schedule.by_uid
        for uid, token, row, spec in zip(step.uids, step.tokens, step.rows, step.spec, strict=True):
            seq = by_uid.get(uid)
            if seq is None:
                continue
            run: list[tuple[int, Any, bool]] = [(token, row.out, False)]
            if spec is not None:
                outs = spec.outs or [None] * len(spec.tokens)
                run += [(t, o, True) for t, o in zip(spec.tokens, outs, strict=True)]
            if seq.ahead:  # its first token, already out (`_first_tokens`)
                seq.ahead = False
                run = run[1:]
            kept = 0
            for tok, lp, drafted in run:
                reason = self._finish(seq, tok, None)
                if reason == "error":
                    ended += 1
                    break  # reported in the step's `failed`
                kept += drafted
                if seq.sampling.logprobs and lp is not None:
                    out.append(TokenOut(seq.rid, tok, reason, lp[0], lp[1]))
                else:
                    out.append(TokenOut(seq.rid, tok, reason))
                if reason is not None:
                    ended += 1
                    break
            if spec is not None:
                self._spec_counts.append((seq.rid, spec.drafted, kept))
        if ended:
            self._admission.finished(time.perf_counter(), ended)
        return tuple(out)

    def _finish(self, seq: Seq, token: int, generator: FinishReason | None) -> FinishReason | None:
        """Count `token` as `seq`'s next and say whether it ends the sequence (the schedule's
        rule: `Schedule.finish`); a failed grammar fails this row in the step's report, and
        an ended sequence's KV is marked for the prompt cache (a failed one's is not)."""
        reason = self.schedule.finish(seq, token, generator)
        if reason == "error":
            if (g := seq.grammar) is not None and g.error:
                self._failed_rows.append((seq.rid, f"constrained decoding failed: {g.error}"))
        elif reason is not None:
            self._reuse.finished(seq.uid, seq.prompt_len + seq.generated, seq.partition)
        return reason

    def _recover(self, exc: BaseException, failed: list[tuple[int, str]]) -> StepReport:
        """A step raised: fail every live sequence, start a fresh generator, keep serving."""
        reason = f"generation step failed: {type(exc).__name__}: {exc}"
        failed = failed + [(rid, reason) for rid in self.schedule.seqs]
        self._reset_batch(failed=True)
        mx.clear_cache()  # what the failed step left allocated goes back (it may have run out)
        self._cached.clear()
        self._spec_counts.clear()
        return StepReport(failed=tuple(failed), live=len(self._admission.pending), prompt_cache=self._reuse.stats())

    def _reset_batch(self, *, failed: bool = False) -> None:
        """Forget every sequence and start a fresh generator: after a failed step, or the
        warm-up's rehearsal. A generator that fails to close is dropped all the same."""
        self._admission.readmit(self._reuse.reset(failed=failed), time.perf_counter())
        self.schedule.clear()
        self._failed_rows.clear()
        self._dry = []
        assert self._bg is not None
        try:
            self._bg.close()
        except Exception:
            pass
        self._bg = self._new_generator()  # if even this raises, the actor dies: engine broken
