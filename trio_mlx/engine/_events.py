"""The public events and records of the channel API: what `engine.generate()` / `engine.chat()`
yield, and what `engine.statistics()` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..actor import FinishReason


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log-probability of one emitted token, with the most likely alternatives: `top`,
    (id, text, logprob) each. A token's text is its bytes decoded, or `bytes:\\xNN...` where
    they are part of a character (OpenAI's form); `raw` and `top_raw` (in `top`'s order) are
    the bytes themselves, which joined rebuild the text."""

    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()
    raw: bytes = b""
    top_raw: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request; `cached_tokens` of the prompt's came from the prompt
    cache (not prefilled again). With speculative decoding (`ActorTuning.speculative`),
    `draft_tokens` were drafted for it and `accepted_draft_tokens` of them kept in its
    completion (counted in `completion_tokens` too)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New text, with the token ids that produced it (several when tokens were waiting).

    For a request with `tools`, `text` is the answer's content only: tool-call
    markup never appears in it (the calls come as `ToolCalls`), and text the
    model's family marks as reasoning (`<think>...</think>`) comes in `reasoning`.
    """

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    reasoning: str = ""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made, as OpenAI's `tool_calls` entries carry it."""

    index: int  # its position among this response's calls
    id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a tool call the model is still writing, as OpenAI streams
    `delta.tool_calls` (a request with `tools`, for families whose calls stream:
    docs/engine.md).

    A call's first delta has its `index`, `id` and `name` and `arguments` "";
    each later one has the next fragment of the arguments' JSON text (`index`,
    `id` and `name` repeated). Joined in order, the fragments are exactly the
    `arguments` of the `ToolCall` that the `ToolCalls` event after them carries.
    A streamed call that then fails to parse gets no `ToolCall` (its text comes
    as content)."""

    index: int
    id: str
    name: str
    arguments: str  # this fragment of the arguments' JSON text ("" in the call's first delta)


@dataclass(frozen=True, slots=True)
class ToolCalls:
    """Tool calls the model finished writing, whole (a request with `tools` only),
    each checked by its family's parser; the request then ends with
    finish_reason "tool_calls". A call that streamed as `ToolCallDelta`s comes
    here too, after its last fragment."""

    calls: tuple[ToolCall, ...]


@dataclass(frozen=True, slots=True)
class Finished:
    """The terminal event of every request; nothing follows it."""

    finish_reason: FinishReason | Literal["tool_calls"]
    usage: Usage
    error: str | None = None
    stop: str | int | None = None  # the stop string or token id that ended it


Event = TextDelta | ToolCallDelta | ToolCalls | Finished


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
    memory_read_at: float = float("-inf")  # trio time the actor read the three figures above
    seconds_since_step: float | None = None
    # The actor's prompt cache: lookups made, hits, prompt tokens served from it, entries
    # evicted, bytes and entries held now.
    prompt_cache_lookups: int = 0
    prompt_cache_hits: int = 0
    prompt_cache_hit_tokens: int = 0
    prompt_cache_evictions: int = 0
    prompt_cache_bytes: int = 0
    prompt_cache_entries: int = 0
    actor_restarts: int = 0  # actors started again after one died (engine/_supervise.py)
    # Chat prompts tokenized only past a recent prompt they repeat, and the tokens whose
    # tokenizing that saved (engine/_prefix_tokens.py).
    tokenizer_prefix_hits: int = 0
    tokenizer_prefix_tokens: int = 0
    # Speculative decoding: tokens drafted, and drafted tokens kept in an output.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # The prompts' tokens of the requests in flight (queued, prefilling or decoding): the load
    # a router reads (`/get_load`).
    prompt_tokens_in_flight: int = 0
