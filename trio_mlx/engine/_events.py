"""The public events and records of the channel API: what `engine.generate()` / `engine.chat()`
yield, and what `engine.statistics()` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..actor import FinishReason


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

    state: Literal["starting", "ready", "restarting", "draining", "closed", "broken"]
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
    actor_restarts: int = 0  # actors started again after one died (engine/_supervise.py)
