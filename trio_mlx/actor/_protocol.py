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
    # The most steps a finished sequence's row may stay in the batch before it
    # is removed (see `Actor._retire_due`); 0 removes at once.
    retire_steps: int = 16
    # Seconds idle before the actor hands MLX's buffer cache back; None: 1 s on
    # a GPU, never on the CPU (see `Actor._idle`); 0: never.
    idle_release: float | None = None
    # The most freed-buffer memory MLX keeps for reuse, in GB; None: MLX's own.
    cache_limit_gb: float | None = None
    # A file the actor appends one line per step to (`_trace.StepTrace`); None: no trace.
    step_trace: str | None = None
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
    blas: str = ""  # on the CPU: which BLAS runs MLX's matmuls (models/_cpu_blas.py)
