"""Messages between the trio-side engine and the GPU actor, and the public events.

Everything that crosses to the actor (a thread, or a process: `_actor_process`)
is an immutable value defined here: commands go engine -> actor through the inbox, one `StepReport` comes
back per decode step. Token ids and plain floats only: MLX arrays never leave
the actor. The public events (`TextDelta`, `Finished`) are what
`engine.generate()` / `engine.chat()` yield to users.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

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
    max_batch: int = 64
    prefill_batch: int = 8
    prefill_step: int = 2048
    warmup: bool = True
    # Seconds a new sequence may wait to be admitted together with others while
    # the batch is decoding (0: no waiting for company). See `_actor._Admission`.
    admit_window: float = 0.0
    # Test-only: called on the actor thread with a stage name ("load", "loop",
    # "step") before that stage runs, and with "removed" right after aborted
    # sequences left the batch; raising from it injects a fault there. A fault
    # in "step" fails the batch and the actor recovers; anywhere else it kills
    # the actor.
    fault_hook: Callable[[str], None] | None = None


@dataclass(frozen=True, slots=True)
class Submit:
    """Insert a sequence into the batch at the next step."""

    rid: int
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]


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


# ---- public events -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log-probability of one emitted token, with the most likely alternatives."""

    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New text, with the token ids that produced it (several when tokens were waiting)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    """The terminal event of every request; nothing follows it."""

    finish_reason: FinishReason
    usage: Usage
    error: str | None = None
    stop: str | int | None = None  # the stop string or token id that ended it


Event = TextDelta | Finished


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """A snapshot of the engine, as `engine.statistics()` returns it."""

    state: Literal["starting", "ready", "draining", "closed", "broken"]
    queued: int
    prefilling: int
    decoding: int
    active: int  # sequences the actor holds (queued in the generator, prefilling or decoding)
    requests_submitted: int
    requests_finished: int
    requests_rejected: int
    decode_steps: int
    generated_tokens: int
    prompt_tokens: int
    last_step_seconds: float
    mean_step_seconds: float
    aborts: int
    aborts_by_stage: dict[str, int] = field(default_factory=dict)
    aborts_by_cause: dict[str, int] = field(default_factory=dict)
    step_failures: int = 0
    active_memory_bytes: int = 0
    peak_memory_bytes: int = 0
    cache_memory_bytes: int = 0  # freed MLX buffers kept for reuse: resident, but not a leak
    seconds_since_step: float | None = None
