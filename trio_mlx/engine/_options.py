"""One request's options as one record, and the engine's one check of them.

`GenerationOptions` is what `Engine.generate` and `Engine.chat` take besides the
prompt: each wire API's request model builds it in one method
(`to_options()`), a library user passes it whole (`options=`) or by its field
names as keywords. It travels unchecked; `check_options` checks it once, when
the request's stream is entered, into what the actor needs (`Checked`: a
frozen `SamplingParams`, the stops, the answer's limit). The ranges here are
what generation itself needs; each API checks its own documented ranges
(OpenAI's temperature 0..2, Anthropic's 0..1) at its own boundary, before the
record is built.

An error names the record's field it is about (`InvalidRequestError.field`),
which each API maps to its own parameter's name (`server/_wire.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import InvalidRequestError
from ..actor import SamplingParams

log = logging.getLogger("trio_mlx.engine")

MAX_STOP_STRINGS = 16
# A stop string is a marker, not a document: the matcher compares the text it holds
# back with each one, so their lengths bound that work (16 stops of 1 MB made one
# step's check of held text take 0.8 s, on the event loop). Judgement.
MAX_STOP_CHARS = 1024
MAX_TOP_LOGPROBS = 20
# A salt names a partition of the prompt cache, not a document. Judgement.
MAX_CACHE_SALT_CHARS = 1024
# The fields a model's generation_config.json may set for the requests that leave them out
# (`Engine.sampling_defaults`): the ones vLLM reads from it by default.
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# The fields only `Engine.chat` reads: a prompt of token ids or text has no template or tools.
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "continue_final_message", "chat_template_kwargs")


@dataclass(frozen=True, kw_only=True)
class GenerationOptions:
    """How to generate one answer: every option of `Engine.generate` and `Engine.chat`.

    A sampling option left out (None) takes the model's default (`Engine.sampling_defaults`),
    else no effect (temperature 1, top_p 1, top_k 0, min_p 0, repetition_penalty 1,
    penalties 0). Nothing is checked when the record is built: the engine checks it once,
    when the request's stream is entered, and raises `InvalidRequestError` naming the field.
    """

    # The most tokens of the answer; None: the engine's `default_max_tokens` (never past the context).
    max_tokens: int | None = None
    # `max_tokens` is a ceiling: where it does not fit beside the prompt, the answer may run to
    # the context's end instead of being refused (`RequestStream.clamped` says it happened;
    # Anthropic's newer models do so).
    fit_max_tokens: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0: no top-k
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[int | str, float] | None = None  # token id -> bias in [-100, 100]
    seed: int | None = None  # a seeded request draws the same tokens in any batch
    stop: str | Sequence[str] | None = None  # stop strings, left out of the text
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False  # generate until max_tokens or a stop
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token, with logprobs
    # OpenAI's: {"type": "json_object"}, or {"type": "json_schema", "json_schema": {"schema":
    # ..., "strict": ...}}: the output is held to it, token by token.
    response_format: Mapping[str, Any] | None = None
    # Chat only (`CHAT_ONLY`): tool calling in OpenAI's shapes (docs/engine.md).
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: str | Mapping[str, Any] | None = None
    parallel_tool_calls: bool = True
    # Continue the last message, the assistant's, rather than answer it (a prefill).
    continue_final_message: bool = False
    chat_template_kwargs: Mapping[str, Any] | None = None
    # The prompt cache's partition, as vLLM's `cache_salt`: the request reuses and leaves
    # cached prefixes only among requests of the same salt, so that its `cached_tokens`
    # reveal nothing of other users' prompts. None: the shared cache.
    cache_salt: str | None = None
    # The named LoRA adapter to answer with (`Engine(adapters=...)`); None: the model alone.
    # The server sets it from the request's model field.
    adapter: str | None = None


@dataclass(frozen=True, slots=True)
class Checked:
    """`GenerationOptions` checked: what the engine submits besides the prompt and its grammar."""

    sampling: SamplingParams
    stop_strings: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    max_tokens: int | None  # as asked; None: the engine's default
    fit_max_tokens: bool
    cache_salt: str = ""  # "": the shared prompt cache
    adapter: str | None = None  # a named LoRA adapter the engine serves; None: none

    @property
    def least_answer(self) -> int:
        """The fewest answer tokens the request insists on beside its prompt."""
        return 1 if self.max_tokens is None or self.fit_max_tokens else self.max_tokens

    def answer_limit(self, room: int, default: int) -> tuple[int, bool]:
        """The answer's max_tokens where `room` tokens are left after the prompt (`default`:
        the engine's default_max_tokens, 0 for none), and whether `fit_max_tokens` cut the
        asked one to the room. The caller refuses a limit past the room; with
        `fit_max_tokens` that only happens where no room is left."""
        if self.max_tokens is None:
            return (min(room, default) if default else room), False
        if self.fit_max_tokens and 1 <= room < self.max_tokens:
            return room, True
        return self.max_tokens, False


def _number(name: str, value: Any, lo: float, hi: float, *, integer: bool = False) -> Any:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or value != value or not lo <= value <= hi:
        what = "an integer" if integer else "a number"
        raise InvalidRequestError(f"{name} must be {what} in [{lo}, {hi}], got {value!r}", param=name)
    return value


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def check_options(o: GenerationOptions, defaults: Mapping[str, Any], vocab: int,
                  adapters: Collection[str] = ()) -> Checked:
    """Check every option before anything reaches the actor, the model's sampling `defaults`
    filling what the request left out; `vocab`: the model's vocabulary size (0: unknown);
    `adapters`: the names of the LoRA adapters the engine serves."""
    if o.max_tokens is not None:
        _number("max_tokens", o.max_tokens, 1, 2**31, integer=True)
    temperature = float(_number("temperature", _or(o.temperature, defaults.get("temperature", 1.0)), 0.0, 100.0))
    top_p = float(_number("top_p", _or(o.top_p, defaults.get("top_p", 1.0)), 0.0, 1.0))
    if top_p == 0.0:
        raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
    top_k = int(_number("top_k", _or(o.top_k, defaults.get("top_k", 0)), 0, 2**31, integer=True))
    if vocab and top_k >= vocab:
        top_k = 0  # keeps every token: the same as no top-k
    min_p = float(_number("min_p", _or(o.min_p, defaults.get("min_p", 0.0)), 0.0, 1.0))
    rep = float(_number("repetition_penalty", _or(o.repetition_penalty, defaults.get("repetition_penalty", 1.0)),
                        1e-3, 100.0))
    presence = float(_number("presence_penalty", _or(o.presence_penalty, 0.0), -2.0, 2.0))
    frequency = float(_number("frequency_penalty", _or(o.frequency_penalty, 0.0), -2.0, 2.0))
    seed = o.seed
    if seed is not None:
        seed = int(_number("seed", seed, -(2**63), 2**64 - 1, integer=True)) & 0xFFFFFFFFFFFFFFFF
    top_logprobs = int(_number("top_logprobs", _or(o.top_logprobs, 0), 0, MAX_TOP_LOGPROBS, integer=True))
    sampling = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=rep,
        presence_penalty=presence,
        frequency_penalty=frequency,
        logit_bias=_logit_bias(o.logit_bias, vocab),
        seed=seed,
        logprobs=bool(o.logprobs) or top_logprobs > 0,
        top_logprobs=top_logprobs,
    )
    stop_ids = tuple(o.stop_token_ids or ())
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < (vocab or 2**31) for i in stop_ids):
        raise InvalidRequestError("stop_token_ids must be token ids of this model", param="stop_token_ids")
    salt = o.cache_salt
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS):
        raise InvalidRequestError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                                  "characters", param="cache_salt")
    if o.adapter is not None and o.adapter not in adapters:
        served = ", ".join(repr(a) for a in adapters) or "none"
        raise InvalidRequestError(f"adapter {o.adapter!r} is not served (adapters: {served})", param="adapter",
                                  code="model_not_found")
    return Checked(sampling, _stops(o.stop), frozenset(stop_ids), bool(o.ignore_eos), o.max_tokens,
                   bool(o.fit_max_tokens), salt or "", o.adapter)


def _logit_bias(given: Any, vocab: int) -> tuple[tuple[int, float], ...]:
    if not given:
        return ()
    if not isinstance(given, Mapping):
        raise InvalidRequestError("logit_bias must map token ids to numbers", param="logit_bias")
    bias: list[tuple[int, float]] = []
    named: set[int] = set()
    for k, v in given.items():
        # A JSON key is a string of ASCII digits; the channel API may pass ints. Not int()'s
        # wider reading ("1_0", " +10", other scripts' digits): two keys could name one token.
        if isinstance(k, str) and k.isascii() and k.isdigit():
            tid = int(k)
        elif isinstance(k, int) and not isinstance(k, bool):
            tid = k
        else:
            raise InvalidRequestError(f"logit_bias key {k!r} is not a token id", param="logit_bias")
        if tid in named:
            raise InvalidRequestError(f"logit_bias names token {tid} twice", param="logit_bias")
        named.add(tid)
        if tid < 0 or (vocab and tid >= vocab) or isinstance(v, bool) or not isinstance(v, (int, float)) \
                or not -100 <= v <= 100:
            raise InvalidRequestError(
                f"logit_bias: token id {k!r} must be in [0, {vocab}) with a bias in [-100, 100]", param="logit_bias"
            )
        bias.append((tid, float(v)))
    return tuple(bias)


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOP_STRINGS or not all(isinstance(s, str) for s in stops):
        raise InvalidRequestError(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings",
                                  param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        # Led by its field, as the other messages are: Anthropic's error body has no param.
        raise InvalidRequestError(f"stop: each string may have at most {MAX_STOP_CHARS} characters", param="stop")
    return tuple(s for s in stops if s)


def check_sampling_defaults(defaults: Mapping[str, Any]) -> None:
    """Refuse defaults the engine's check would refuse in every request (`Engine(sampling_defaults=)`)."""
    if unknown := set(defaults) - set(SAMPLING_DEFAULT_KEYS):
        raise ValueError(f"sampling_defaults takes {SAMPLING_DEFAULT_KEYS}, not {sorted(unknown)}")
    try:
        check_options(GenerationOptions(**defaults), {}, 0)
    except InvalidRequestError as exc:
        raise ValueError(f"sampling_defaults: {exc}") from None


def usable_defaults(found: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The model's sampling defaults (`models.sampling_defaults`) that the engine's check
    accepts; the others are left out with a warning, so that a broken file cannot make every
    request fail."""
    out: dict[str, Any] = {}
    for key in SAMPLING_DEFAULT_KEYS:
        if key not in found:
            continue
        value = found[key]
        try:
            check_options(GenerationOptions(**{key: value}), {}, 0)
        except InvalidRequestError as exc:
            log.warning("%s: %s; left out of the sampling defaults", source, exc.message)
            continue
        out[key] = value
    return out
