"""Server settings: one frozen record, read from TRIO_MLX_* environment variables or flags.

Every field of `Settings`, and of the `ActorTuning` it nests (`settings.tuning`, the
engine's record: one default per knob, the library's), is settable three ways, in this
order of precedence: a `trio-mlx serve` flag (`--max-batch 32`), an environment variable
(`TRIO_MLX_MAX_BATCH=32`), the default. Flags and variables name a field flat, nested or
not (`setting_fields`). `trio_mlx.app:app` under any ASGI server reads only the environment.
Parsing is strict: a bad value names its variable and stops the server before it loads
anything.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from .._fields import ENV_PREFIX as ENV_PREFIX
from .._fields import doc as _doc
from .._fields import env_name as env_name
from .._fields import field_kind as field_kind
from .._fields import parse_value as parse_value
from .._fields import read_environ
from ..engine import ActorTuning, Engine, find_models

# The id /v1/models serves for the embedded default (docs/design.md); as models.EMBEDDED_DEFAULT,
# which this module does not import (that would import MLX).
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


# The engine's own defaults, for the settings it shares with the library (one default per knob).
_LIBRARY = {name: p.default for name, p in inspect.signature(Engine).parameters.items()}


@dataclass(frozen=True)
class Settings:
    """Everything the HTTP server and its engine are configured with."""

    model: str | None = field(default=None, metadata=_doc(
        "model to serve: a local MLX directory or a Hugging Face id; unset: the embedded default"))
    models: tuple[str, ...] = field(default=(), metadata=_doc(
        "serve several models, each loaded on first use (instead of model): folders of model "
        "folders (each subfolder with a config.json is a model, named after it), model folders, "
        "or NAME=REF pairs; comma-separated or repeated. A request names one in its model field; "
        "/v1/models lists them all; they share the one GPU thread, a step serving one model's batch"))
    max_loaded_models: int = field(default=1, metadata=_doc(
        "with models: the most loaded at once. Loading one more first unloads the least recently "
        "used model with no request in flight; when every loaded model has requests, the request "
        "gets 503 with Retry-After"))
    max_loaded_gb: float = field(default=0.0, metadata=_doc(
        "with models: the most GB of weights (the model folders' .safetensors files) loaded at once, "
        "beside max_loaded_models: idle models are unloaded, least recently used first, to make room; "
        "a model larger than this by itself loads alone; 0: no bound but max_loaded_models"))
    model_adapters: tuple[str, ...] = field(default=(), metadata=_doc(
        "with models: named LoRA adapters over one of the models, each MODEL:NAME=PATH (a directory "
        "as mlx_lm.lora writes it), the flag once per adapter; a request names one as MODEL:NAME; "
        "each is checked and loaded with its model, under the rules of adapter", flag="model-adapter"))
    model_name: str | None = field(default=None, metadata=_doc(
        "the model id served in /v1/models and accepted in requests; default: derived from the model"))
    host: str = field(default="127.0.0.1", metadata=_doc("address to bind (trio-mlx serve)"))
    port: int = field(default=8000, metadata=_doc("port to bind (trio-mlx serve); 0 picks a free one"))
    # The actor's knobs: each is a flag and a variable of its own (`--max-batch`,
    # TRIO_MLX_MAX_BATCH), listed here in their place; the engine takes the record whole.
    tuning: ActorTuning = field(default_factory=ActorTuning, metadata=_doc(
        "the GPU actor's tuning (trio_mlx.ActorTuning)", nested=True))
    max_queue: int = field(default=_LIBRARY["max_queue"], metadata=_doc("waiting requests before new ones get 429"))
    cache_dir: str | None = field(default=None, metadata=_doc("where converted models are cached"))
    actor: str = field(default=_LIBRARY["actor"], metadata=_doc(
        "where the GPU actor runs: 'thread' (a dedicated thread of the server's process) or "
        "'process' (a child process with its own GIL, so HTTP work does not slow decoding: "
        "the highest throughput at the top of concurrency, and for host-bound work such as a "
        "draft model's; "
        "~1-2 s more to start)"))
    generation_config: str = field(default="auto", metadata=_doc(
        "sampling defaults for requests that leave temperature, top_p, top_k, min_p or "
        "repetition_penalty out: 'auto' takes the model's generation_config.json (as vLLM "
        "does), 'none' the neutral values (temperature 1, top_p 1, ...)"))
    restart_limit: int = field(default=_LIBRARY["restart_limit"], metadata=_doc(
        "times a GPU actor that died is started again within restart_window seconds; past it the "
        "server exits non-zero for its supervisor to act; 0: never (exit at the first death)"))
    restart_window: float = field(default=_LIBRARY["restart_window"], metadata=_doc(
        "seconds over which restart_limit counts restarts"))
    restart_backoff: float = field(default=_LIBRARY["restart_backoff"], metadata=_doc(
        "seconds before the first restart; each further one within restart_window waits twice "
        "as long (at most 30)"))
    drain_timeout: float = field(default=20.0, metadata=_doc(
        "seconds in-flight requests may run on after SIGTERM before they are ended"))
    stall_timeout: float = field(default=30.0, metadata=_doc(
        "seconds a streaming client may stop reading before its request is aborted"))
    max_unread_tokens: int = field(default=2048, metadata=_doc(
        "tokens a streaming client that stopped reading (its socket full) may fall behind before "
        "its request is aborted as stalled, whatever stall_timeout says; 0: only the timeout"))
    watchdog_seconds: float = field(default=30.0, metadata=_doc(
        "/health turns 503 when work is pending and no decode step completed for this long"))
    ping_interval: float = field(default=10.0, metadata=_doc(
        "seconds between ': ping' SSE comments while a streamed request is queued or prefilling"))
    stream_interval: float = field(default=0.0, metadata=_doc(
        "least seconds between two SSE events of one stream; 0: one event per engine wake-up. "
        "Larger values send fewer, bigger events (less event-loop CPU, coarser streaming)"))
    max_event_rate: float = field(default=500.0, metadata=_doc(
        "SSE events per second across all streams that pacing aims at: each stream waits "
        "(open streams / rate) seconds, at most 0.25, between events, so under load tokens "
        "coalesce into fewer events and the event loop leaves the GIL to the GPU actor; 0: off"))
    api_key: str | None = field(default=None, metadata=_doc(
        "require 'Authorization: Bearer <key>' on /v1/* when set; several keys separated by commas",
        secret=True))
    prompt_cache_isolation: str = field(default="shared", metadata=_doc(
        "who shares the prompt cache: 'shared' (every request, as the cached_tokens of each show: "
        "one user can learn another's prompt from them) or 'key' (only requests made with the same "
        "API key; needs api_key). A request's cache_salt partitions it further in either case"))
    model_aliases: tuple[str, ...] = field(default=(), metadata=_doc(
        "NAME=TARGET pairs (comma-separated or repeated): a request whose model is NAME (a glob: "
        "'claude-*', 'gpt-4*') is served by TARGET, the served model's id or one of its adapters; "
        "the first that matches wins", flag="model-alias"))
    cors_origins: tuple[str, ...] = field(default=(), metadata=_doc(
        "comma-separated origins allowed by CORS ('*' for any); empty: no CORS headers"))
    allowed_hosts: tuple[str, ...] = field(default=(), metadata=_doc(
        "comma-separated Host names accepted on connections over loopback besides localhost, "
        "127.0.0.0/8 and [::1] ('.example.com': the domain and its subdomains; '*': any), "
        "for a local reverse proxy; others get 403 (DNS rebinding)"))
    max_connections: int = field(default=0, metadata=_doc(
        "most open connections (trio-mlx serve); more are answered 503 and closed at once; "
        "0: the open-file limit (raised to its hard limit at startup) less a reserve"))
    backlog: int = field(default=2048, metadata=_doc(
        "the listen queue (trio-mlx serve): connections the kernel holds before the server "
        "accepts them (capped by net.core.somaxconn)"))
    body_timeout: float = field(default=20.0, metadata=_doc(
        "seconds a client may take to send its whole request body (408 after)"))
    max_body_bytes: int = field(default=16 * 1024 * 1024, metadata=_doc(
        "largest request body accepted; larger ones get 413"))
    default_max_tokens: int = field(default=_LIBRARY["default_max_tokens"], metadata=_doc(
        "the most tokens an answer gets when its request names no max_tokens (the chat page, aider, "
        "Codex and many SDK calls name none), never past the context; 0: up to the context's end"))
    max_n: int = field(default=16, metadata=_doc("largest n (choices per request) accepted"))
    max_messages: int = field(default=4096, metadata=_doc(
        "most messages a request may have (and never more than the context has tokens): chat and "
        "Anthropic messages, Anthropic tool_result blocks, Responses input items; counted before "
        "they are validated"))
    startup_timeout: float = field(default=600.0, metadata=_doc(
        "seconds model loading (download, conversion, warm-up) may take (trio-mlx serve); with "
        "models, each load on demand too: past it, the requests waiting for it get 503 with Retry-After"))
    access_log: bool = field(default=True, metadata=_doc(
        "log one line per request, ending with its X-Request-Id (trio-mlx serve)"))
    replica: str | None = field(default=None, metadata=_doc(
        "this server's name among several replicas of the model on one host (behind a router, "
        "docs/distributed.md, \"Scaling out\"): replicas with different names may serve the same "
        "model on the same device, a second server of the same name is refused; shown on /health "
        "and /server_info"))
    allow_multiple_workers: bool = field(default=False, metadata=_doc(
        "let several processes (hypercorn workers) serve this model on one device, each loading "
        "its own copy; unset, a second one stops at startup"))
    distributed: str | None = field(default=None, metadata=_doc(
        "serve one model sharded over the ranks mlx.launch started: 'tensor' (every rank holds a "
        "slice of each layer: llama, mistral, qwen2, qwen3, qwen3_moe, deepseek, glm4_moe, gpt_oss and "
        "the other families whose mlx-lm model has a shard method) or 'pipeline' (each rank a run of "
        "layers; in mlx-lm 0.32 qwen2, qwen3_moe, qwen3_5, qwen3_next, deepseek_v2/v3/v32/v41, "
        "glm4_moe(_lite), kimi_k3, ministral3, mistral4, minimax_m3_vl, bailing_hybrid and muse_spark, "
        "not llama, mistral or dense qwen3); rank 0 serves HTTP, the others follow (docs/distributed.md)"))
    distributed_backend: str = field(default="any", metadata=_doc(
        "mx.distributed backend: ring, jaccl, mpi, nccl, or 'any' (the one mlx.launch set up)"))
    distributed_timeout: float = field(default=60.0, metadata=_doc(
        "seconds one step or command exchange of a distributed group may take; past it (a rank "
        "died or hung) requests end with an error and every rank exits"))
    log_level: str = field(default="info", metadata=_doc("debug, info, warning or error"))

    def __post_init__(self) -> None:
        # The tuning checks its own fields (`ActorTuning.__post_init__`).
        for name in ("max_n", "max_messages", "backlog"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_queue", "max_body_bytes", "port", "restart_limit", "max_connections",
                     "max_unread_tokens", "default_max_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("drain_timeout", "stall_timeout", "watchdog_seconds", "ping_interval", "startup_timeout",
                     "stream_interval", "max_event_rate", "restart_window", "restart_backoff", "body_timeout"):
            value = getattr(self, name)
            zero_ok = name in ("drain_timeout", "stream_interval", "max_event_rate", "restart_backoff")  # drain 0: end in-flight at once
            if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
                raise ValueError(f"{name} must be a finite number {'>= 0' if zero_ok else '> 0'}, got {value}")
        if self.generation_config not in ("auto", "none"):
            raise ValueError(f"generation_config must be 'auto' or 'none', got {self.generation_config!r}")
        if self.prompt_cache_isolation not in ("shared", "key"):
            raise ValueError(f"prompt_cache_isolation must be 'shared' or 'key', got {self.prompt_cache_isolation!r}")
        if self.prompt_cache_isolation == "key" and not self.api_key:
            raise ValueError("prompt_cache_isolation 'key' needs api_key: without keys every request is one user's")
        if self.actor not in ("thread", "process"):
            raise ValueError(f"actor must be 'thread' or 'process', got {self.actor!r}")
        if self.distributed not in (None, "tensor", "pipeline"):
            raise ValueError(f"distributed must be 'tensor' or 'pipeline', got {self.distributed!r}")
        if self.distributed_backend not in ("any", "ring", "jaccl", "mpi", "nccl"):
            raise ValueError(f"distributed_backend must be any, ring, jaccl, mpi or nccl, got {self.distributed_backend!r}")
        if not (math.isfinite(self.distributed_timeout) and self.distributed_timeout > 0):
            raise ValueError(f"distributed_timeout must be a finite number > 0, got {self.distributed_timeout}")
        if self.distributed and self.tuning.prompt_cache_disk_gb:
            raise ValueError("prompt_cache_disk_gb needs a single rank: each rank of a distributed group "
                             "holds its own shard of the prompt cache")
        if self.distributed and self.tuning.speculation is not None:
            raise ValueError("speculative decoding (speculative, draft_model) needs a single rank, not a "
                             "distributed group")
        if self.distributed and self.tuning.kv_bits is not None:
            raise ValueError("kv_bits needs a single rank, not a distributed group (the quantized KV cache "
                             "is not built for one): unset kv_bits or distributed")
        if self.distributed and self.tuning.adapter_path:
            raise ValueError("adapter_path needs a single rank, not a distributed group (each rank loads "
                             "its own shard of the weights, without the adapter)")
        if self.served_model_name in self.tuning.adapter_map:
            raise ValueError(f"adapters: {self.served_model_name!r} is the served model's own name; name the "
                             "adapter otherwise (or the model: model_name)")
        for alias in self.model_aliases:
            pattern, eq, target = alias.partition("=")
            if not eq or not pattern.strip() or self.serves(target) is False:
                served = ", ".join(repr(n) for n in (*(self.model_table or [self.served_model_name]),
                                                     *self.tuning.adapter_map))
                raise ValueError(f"model_aliases: {alias!r} is not NAME=TARGET with TARGET one of {served}")
        if self.distributed and self.tuning.adapters:
            raise ValueError("adapters need a single rank, not a distributed group (each rank loads its own "
                             "shard of the weights, without the adapters)")
        if self.distributed and self.actor != "thread":
            raise ValueError("distributed needs actor 'thread': rank 0's server watches its group (the ranks' "
                             "states on /health, a lost rank failing every request) through the actor it runs "
                             "in its own process; the process actor is for a single device")
        if self.replica is not None and not (
                0 < len(self.replica) <= 64 and all(c.isalnum() or c in "-_." for c in self.replica)):
            raise ValueError(f"replica must be up to 64 letters, digits, '-', '_' or '.', got {self.replica!r}")
        if not (math.isfinite(self.max_loaded_gb) and self.max_loaded_gb >= 0):
            raise ValueError(f"max_loaded_gb must be a finite number >= 0, got {self.max_loaded_gb}")
        if self.max_loaded_models < 1:
            raise ValueError(f"max_loaded_models must be >= 1, got {self.max_loaded_models}")
        if self.models:
            self._check_models()
        elif self.model_adapters:
            raise ValueError("model_adapters needs models (one model's adapters: adapter NAME=PATH)")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")

    def _check_models(self) -> None:
        """What a server of several models (`models`) cannot be combined with."""
        for name, clash in (("model", self.model), ("model_name", self.model_name),
                            ("distributed", self.distributed), ("adapter_path", self.tuning.adapter_path),
                            ("adapters", self.tuning.adapters), ("draft_model", self.tuning.draft_model),
                            ("step_trace", self.tuning.step_trace)):
            if clash:
                over = " (adapters over one of them: model_adapter MODEL:NAME=PATH)" if "adapter" in name else ""
                raise ValueError(f"models serves several models, each by its own name: unset {name}{over}")
        if self.actor != "thread":
            raise ValueError("models needs actor 'thread': the models share the one GPU thread of the process")
        try:
            self.model_table  # noqa: B018  (a folder without models fails here, at startup)
        except ValueError as exc:
            raise ValueError(f"models: {exc}") from None
        for name in self.model_adapter_map:
            try:
                self.model_tuning(name)  # the tuning's own checks of adapters: names, decode_step
            except ValueError as exc:
                raise ValueError(f"model_adapters of {name!r}: {exc}") from None

    @functools.cached_property
    def model_table(self) -> dict[str, str]:
        """With `models`: every model by the name requests use (`engine.find_models`); else empty."""
        return find_models(self.models) if self.models else {}

    @functools.cached_property
    def model_adapter_map(self) -> dict[str, dict[str, str]]:
        """With `models`: each model's named adapters (`model_adapters`), {model: {name: path}},
        in the order given; a model listed nowhere is a ValueError."""
        out: dict[str, dict[str, str]] = {}
        for entry in self.model_adapters:
            ref, eq, path = entry.partition("=")
            model, colon, name = ref.strip().rpartition(":")  # a model's name may hold a ':', an adapter's not
            if not (eq and colon):
                raise ValueError(f"model_adapters: each entry is MODEL:NAME=PATH, got {entry!r}")
            if model not in self.model_table:
                raise ValueError(f"model_adapters: {entry!r} names {model!r}, which models does not list")
            if f"{model}:{name}" in self.model_table:
                raise ValueError(f"model_adapters: {model}:{name} is also a model's name")
            adapters = out.setdefault(model, {})
            if name in adapters:
                raise ValueError(f"model_adapters: {model}:{name} is given twice")
            adapters[name] = path.strip()
        return out

    def model_tuning(self, name: str) -> ActorTuning:
        """With `models`: the tuning the model `name` loads with, its own adapters in it."""
        adapters = self.model_adapter_map.get(name)
        if not adapters:
            return self.tuning
        return dataclasses.replace(self.tuning, adapters=tuple(f"{n}={p}" for n, p in adapters.items()))

    def serves(self, name: str) -> str | None | bool:
        """What `name` names without an alias: None for the served model (with `models`, any
        of them), an adapter's name for that adapter (`NAME` or `MODEL:NAME`; with `models`,
        `MODEL:NAME` of that model's), False for anything else."""
        if self.models:
            if name in self.model_table:
                return None
            model, _, adapter = name.rpartition(":")
            return adapter if adapter in self.model_adapter_map.get(model, {}) else False
        base, adapters = self.served_model_name, self.tuning.adapter_map
        if name == base:
            return None
        if name in adapters:
            return name
        if name.startswith(base + ":") and name[len(base) + 1:] in adapters:
            return name[len(base) + 1:]
        return False

    @functools.cached_property
    def served_model_name(self) -> str:
        """The id clients see: MODEL_NAME, else the hub id, else the local directory's name.
        Worked out once (it may look at the file system): every request compares against it."""
        if self.model_name:
            return self.model_name
        if self.models:  # the first of several: what a request that names no model gets
            return next(iter(self.model_table))
        if not self.model or self.model in ("default", DEFAULT_MODEL_NAME):
            return DEFAULT_MODEL_NAME
        ref = self.model.rstrip("/\\")
        if os.path.exists(ref) or ref.startswith((".", "/", "~")) or ref.count("/") != 1:
            return PurePath(ref).name or ref
        return ref  # "org/name": a Hugging Face id, served as is (as mlx_lm.server does)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from TRIO_MLX_* variables; `overrides` (already typed, by flat field names:
        `max_batch=8` sets the tuning's) win over them. A whole `tuning=` record replaces the
        tuning's variables; flat tuning overrides still apply on top of it."""
        environ = os.environ if environ is None else environ
        values = {**read_environ(setting_fields(), environ, overrides), **overrides}
        knobs = {name: values.pop(name) for name in list(values) if name in _TUNING_NAMES}
        if "tuning" in overrides:
            knobs = {name: overrides[name] for name in knobs if name in overrides}
        values["tuning"] = dataclasses.replace(values.get("tuning") or ActorTuning(), **knobs)
        return cls(**values)

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name (the tuning's in its place), as flags name them."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.metadata.get("nested"):
                out.update(dataclasses.asdict(getattr(self, f.name)))
            else:
                out[f.name] = getattr(self, f.name)
        return out

    def public(self) -> dict[str, Any]:
        """The settings with secrets masked, by flat name, for logs."""
        secret = {f.name for f in setting_fields() if f.metadata.get("secret")}
        return {name: "***" if name in secret and value else value for name, value in self.flat().items()}


_TUNING_NAMES = frozenset(f.name for f in dataclasses.fields(ActorTuning))


def setting_fields() -> tuple[dataclasses.Field[Any], ...]:
    """Every field a flag and a variable name: Settings' own, with the tuning's fields in
    place of the `tuning` record (so a new `ActorTuning` field is a new flag and variable)."""
    out: list[dataclasses.Field[Any]] = []
    for f in dataclasses.fields(Settings):
        out.extend(dataclasses.fields(ActorTuning) if f.metadata.get("nested") else (f,))
    return tuple(out)
