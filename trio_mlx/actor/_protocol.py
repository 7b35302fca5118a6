"""The engine-actor protocol: every message between the trio-side engine and the GPU actor.

Everything that crosses to the actor (a thread, or a process: `_process.py`)
is an immutable value defined here: commands go engine -> actor through the
inbox, one `StepReport` comes back per decode step. Token ids and plain floats
only: MLX arrays never leave the actor. The public events users see are in
`engine/_events.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ._tuning import ActorTuning

FinishReason = Literal["stop", "length", "abort", "error"]
Stage = Literal["queued", "prefill", "decode"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling options; every one is served inside the shared batch."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# ---- engine -> actor ---------------------------------------------------------


@dataclass(frozen=True)
class ActorConfig:
    """How the actor loads and batches; built by the engine, crosses to a process actor pickled."""

    model_path: Path
    # Every knob a user sets (`_tuning.py`): the engine's record, passed on whole.
    tuning: ActorTuning = ActorTuning()
    # The prompt cache's disk tier (`_disk_cache.py`): the folder its entries are kept under
    # across restarts (the engine's cache_dir/prompt-cache); None: off.
    prompt_cache_disk: str | None = None
    # The draft model of speculative decoding, resolved to a directory by the engine
    # (`ActorTuning.draft_model` names it); None: the tuning's draft_model as a path.
    draft_model_path: Path | None = None
    # The share of the device's default prompt cache bound (without `tuning.prompt_cache_gb`)
    # this actor takes: 1/N on a host of several models that may hold N at once (`_host.py`).
    prompt_cache_share: float = 1.0
    # Test-only: called on the actor thread with a stage name ("load", "loop",
    # "step") before that stage runs, and with "removed" right after aborted
    # sequences left the batch; raising from it injects a fault there. A fault
    # in "step" fails the batch and the actor recovers; anywhere else it kills
    # the actor.
    fault_hook: Callable[[str], None] | None = None


GrammarKind = Literal["json_object", "json_schema", "tools", "lark"]


@dataclass(frozen=True, slots=True)
class Grammar:
    """A validated grammar (`engine/_grammar.py` compiles it), ready to travel to the
    actor inside a Submit: plain strings and an int, so it pickles for the process actor."""

    source: str  # llguidance's grammar text; `llguidance.LLMatcher(tokenizer, source)` takes it
    # Tokens the engine's own completion (`actor/_matcher.finish`) takes from the
    # start, EOS included: with max_tokens at least this, the output is always
    # complete. A model may well finish in fewer (its tokens are longer).
    min_tokens: int
    kind: GrammarKind


@dataclass(frozen=True, slots=True)
class Submit:
    """Insert a sequence into the batch at the next step."""

    rid: int
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    # Constrained decoding: the actor masks this row's logits to the grammar
    # (`_constrain.GrammarProcessor`), inside the shared batch (rule 5).
    grammar: Grammar | None = None
    # The prompt cache's partition (`_prompt_cache.keyed`): only requests of one salt share
    # cached prefixes; "" is the shared cache.
    cache_salt: str = ""
    # The named LoRA adapter this row runs with (`ActorTuning.adapters`); None: the model alone.
    adapter: str | None = None

    @property
    def partition(self) -> str | tuple[str, str]:
        """The prompt cache's partition this request reads and writes: its salt, and, for a
        row on an adapter, the adapter too (its KV is another model's: no other adapter's
        request, nor the model's own, may reuse it). A pair, never equal to a salt's string."""
        return self.cache_salt if self.adapter is None else (self.adapter, self.cache_salt)


@dataclass(frozen=True, slots=True)
class Abort:
    """Remove a sequence from the batch, whatever stage it is in."""

    rid: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Drop every sequence, free MLX state and return from the actor thread."""


Command = Submit | Abort | Shutdown


# ---- actor -> engine ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenOut:
    """One token of one sequence, produced by one decode step."""

    rid: int
    token: int
    finish_reason: FinishReason | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass(frozen=True, slots=True)
class StepReport:
    """Everything one actor step produced; handed over in one thread crossing."""

    tokens: tuple[TokenOut, ...] = ()
    prefilling: tuple[int, ...] = ()  # rids whose prompt processing began this step
    decoding: tuple[int, ...] = ()  # rids that finished prefill this step
    failed: tuple[tuple[int, str], ...] = ()  # (rid, reason): the step raised
    prompt_tokens: int = 0  # prompt tokens processed this step
    step_seconds: float = 0.0
    live: int = 0  # sequences in the BatchGenerator after this step
    memory: tuple[int, int, int] | None = None  # MLX (active, peak, cache) bytes, read now and then
    cached: tuple[tuple[int, int], ...] = ()  # (rid, prompt tokens taken from the prompt cache), on entry
    # The prompt cache's (lookups, hits, hit tokens, evictions, bytes held, entries), when they changed.
    prompt_cache: tuple[int, ...] | None = None
    # Speculative decoding: (rid, tokens drafted, drafted tokens kept in its output) per
    # sequence that took a speculative step in this step.
    speculated: tuple[tuple[int, int, int], ...] = ()
    # Whether `tokens` holds first tokens read in the step that sampled them (`Actor._first_tokens`):
    # a request's time to first token, which a link hands over at once (`ThreadLink.exchange`).
    # For the actor's side of a link alone: the process actor's pipe leaves it out.
    first: bool = False


@dataclass(frozen=True, slots=True)
class ActorInfo:
    """What the actor tells the engine once the model is loaded and warm."""

    model_type: str
    context_length: int
    vocab_size: int
    thread_id: int
    device: str
    load_seconds: float
    pid: int = 0  # the process the actor runs in: the server's, or its own (actor="process")
    # The prompt cache's bound in bytes; 0: off (set so, or the model's cache is not a plain
    # KV cache per layer and cannot be cut back to a prefix).
    prompt_cache_bytes: int = 0
    blas: str = ""  # on the CPU: which BLAS runs MLX's matmuls (models/_cpu_blas.py)
