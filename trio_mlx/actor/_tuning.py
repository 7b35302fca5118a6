"""`ActorTuning`: how the GPU actor batches, admits, retires and caches; one record, one default per knob.

The server nests it in its `Settings`, the engine takes it whole (`Engine(tuning=...)`, or
any of its fields as a keyword) and hands it on inside `ActorConfig`, rank 0 of a
distributed group sends it to the other ranks. Every field is also a `trio-mlx serve`
flag and a TRIO_MLX_* variable, named after it and described by its `doc` (`_fields.py`):
a new knob is one field here. No MLX.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._fields import doc, read_environ

# The most drafted tokens per speculative step, and the longest n-gram: a bound on one
# step's width (a forward over 65 tokens is a short prefill), not a recommendation.
MAX_DRAFT = 64
# What `mx.quantize` offers for the KV cache (`kv_bits`, `_kv_quant.py`): bits, and group sizes
# (which must also divide the model's head dim, checked when it loads).
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)


# An adapter's name: what a request's model field names (alone, or after "MODEL:").
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _adapter_entries(given: Any) -> tuple[str, ...]:
    """`adapters` as NAME=PATH strings, from those or a {name: path} mapping; a bad name, a
    repeated one or a missing path is a ValueError naming it."""
    if isinstance(given, Mapping):
        pairs = [(str(k), str(v)) for k, v in given.items()]
    elif isinstance(given, (tuple, list)):
        pairs = []
        for entry in given:
            if not isinstance(entry, str) or "=" not in entry:
                raise ValueError(f"adapters: each entry is NAME=PATH, got {entry!r}")
            name, path = entry.split("=", 1)
            pairs.append((name.strip(), path.strip()))
    else:
        raise ValueError(f"adapters: NAME=PATH entries or a {{name: path}} mapping, got {given!r}")
    seen: set[str] = set()
    for name, path in pairs:
        if not _ADAPTER_NAME.fullmatch(name):
            raise ValueError(f"adapters: the name {name!r} must be 1 to 64 letters, digits, '.', '_' or '-' "
                             "(starting with a letter or digit)")
        if name in seen:
            raise ValueError(f"adapters: the name {name!r} is given twice")
        if not path:
            raise ValueError(f"adapters: {name!r} names no path")
        seen.add(name)
    return tuple(f"{name}={path}" for name, path in pairs)


@dataclass(frozen=True)
class ActorTuning:
    """The GPU actor's tuning; every field is a `trio-mlx serve` flag and a TRIO_MLX_* variable."""

    max_batch: int = field(default=64, metadata=doc("most sequences decoded together"))
    prefill_batch: int = field(default=8, metadata=doc(
        "prompts a prefill group takes whatever their length (at most max_batch); while 32 or more "
        "sequences decode (at most half of max_batch), or none, short ones make groups of up to that many, "
        "holding at most prefill_batch x prefill_step / 2 tokens"))
    prefill_step: int = field(default=2048, metadata=doc(
        "most tokens of a prompt processed per prefill step (fewer when many long prompts prefill "
        "together, so that one step's attention fits 4 GiB)"))
    # `Actor._cut_prefill`; None is `_memory.PREFILL_BUDGET_CPU` on the CPU. Never cuts a chunk
    # under 128 tokens (512 on CUDA's shape grid).
    prefill_budget: int | None = field(default=None, metadata=doc(
        "most prompt tokens one prefill step takes, across its group, while other sequences decode: "
        "long prompts then prefill in chunks (never under 128 tokens each), with a decode step of the "
        "running streams between them; unset: 1024 on the CPU, no bound on a GPU; 0: no bound"))
    # `_admission.py` says why, and how the wait shrinks when few sequences decode; 20 ms is a
    # few decode steps of a small model.
    admit_window: float = field(default=0.02, metadata=doc(
        "seconds a new request may wait to join a decoding batch together with others (fewer, "
        "larger admissions: each one slows the next decode steps), in full once prefill_batch "
        "sequences decode, in proportion below; 0: no waiting for company"))
    warmup: bool = field(default=True, metadata=doc(
        "generate before reporting ready, so first requests pay no kernel compiles: on a GPU "
        "a prefill of every group size up to 32 (a group of short prompts; at most half of max_batch) "
        "and a rehearsal of the actor's other paths (removals, sampling options, logprobs, an abort), "
        "on the CPU one short sequence"))
    retire_steps: int = field(default=16, metadata=doc(  # `_schedule.Schedule`
        "the most decode steps a finished sequence's row may stay in the batch before it is "
        "removed together with others (removals cost host time per change); 0: at once"))
    decode_step: str = field(default="owned", metadata=doc(  # `_decode.py`, or `_batch.py`'s
        "the actor's decode step: 'owned' (one forward over the decoding batch, every row's sampling "
        "batched on the device, the next step started before this one's tokens are read) or 'mlx' "
        "(mlx-lm's BatchGenerator step, a sampler and logits processors per row), to compare the two"))
    grammar_masks: str = field(default="auto", metadata=doc(  # `_decode.py`
        "when a decode step fills its constrained sequences' grammar masks: 'after' the forward is "
        "started (while the device runs it), 'before' (the forward built, then last step's tokens read and "
        "the masks filled in a thread while MLX encodes and starts it: for steps bound by the host), or "
        "'auto' ('before' while the device is seen waiting for the host, the batch holds 8 constrained "
        "sequences or more, and reading first waits less than the masks take); 'before' needs decode_step 'owned', "
        "and with decode_step 'mlx' 'auto' is 'after'"))
    # `_speculate.py` (the rules), `_drafting.py` (the drafters), `_spec_step.py` (the step).
    speculative: str | None = field(default=None, metadata=doc(
        "speculative decoding, for the sequences of a batch of up to speculative_max_rows: 'ngram' (prompt "
        "lookup: drafts copied from the sequence's own prompt and output where its last tokens "
        "occurred before) or 'draft' (a draft model: draft_model, which implies it); each step verifies "
        "the drafts in one forward and keeps those the model agrees with, so outputs are unchanged; "
        "a sequence whose drafts are seldom accepted stops speculating for a while; unset: off"))
    num_draft_tokens: int | None = field(default=None, metadata=doc(
        "the most tokens drafted and verified per speculative step; unset: 32 with ngram (a sequence "
        "starts at 16, or this if fewer, and doubles after a step whose drafts were all kept), 4 "
        "with a draft model"))
    speculative_max_rows: int = field(default=8, metadata=doc(
        "the widest decoding batch that speculates: in a wider one every sequence takes plain steps "
        "(verifying drafts costs more than it gives once a forward is no longer bound by reading the "
        "weights); 1: only a sequence that decodes alone"))
    # 8, not 3: text repeats short phrases inside what it copies, and a suffix of 3 tokens
    # follows the wrong one of them (SmolLM2 looping on a 20-token sentence that says one
    # 7-token phrase twice kept 40% of its drafts at 3, 96% at 8). The index's host memory
    # grows with it: ~160 MB for a 128k-token sequence at 8.
    ngram_size: int = field(default=8, metadata=doc(
        "prompt lookup's longest match: the drafts follow the latest earlier occurrence of the "
        "longest suffix of the sequence, of this many tokens down to two (one where this is 1)"))
    draft_model: str | None = field(default=None, metadata=doc(
        "the draft model of speculative decoding (a local MLX model directory or a Hugging Face id): "
        "any mlx-lm model with the served model's tokenizer, much smaller than it"))
    # `models.load_model(adapter_path=...)`: mlx-lm's own `load_adapters`, before the warm-up.
    adapter_path: str | None = field(default=None, metadata=doc(
        "a LoRA (or DoRA) adapter directory, as mlx_lm.lora writes it (adapter_config.json and "
        "adapters.safetensors), applied over the model's weights: every request is served by the "
        "adapted model, as mlx_lm.server's --adapter-path; not with distributed"))
    # `_kv_quant.py`: the batch's quantized cache; `Actor._load` checks the model takes it.
    kv_bits: int | None = field(default=None, metadata=doc(
        "store the KV cache quantized at this many bits (4 or 8; 2, 3, 5 and 6 where the device "
        "runs them), as mlx_lm.server's --kv-bits: 8 bits hold a sequence's KV in about half the "
        "memory of bf16, 4 bits in about a quarter, so more and longer conversations fit, at some "
        "cost in quality (docs/server.md); the prompt cache (and its disk tier) holds it quantized too; "
        "not with distributed; unset: the model's own precision"))
    kv_group_size: int = field(default=64, metadata=doc(
        "the group size of kv_bits' quantization (32, 64 or 128: each group of this many values "
        "of a head vector shares a scale and a bias); it must divide the model's head dim"))
    # 0 only: `_kv_quant.py` says why.
    quantized_kv_start: int = field(default=0, metadata=doc(
        "the token from which kv_bits quantizes a sequence's KV: 0 only, from its first token, so "
        "that a sequence's tokens do not depend on the batch it shares, on how its prompt was "
        "chunked or on a prompt-cache hit (mlx-lm defaults to 5000 and converts a sequence's cache "
        "once it passes that many tokens, at full precision until then); other values are refused"))
    # `models.load_model(adapters=...)` stacks them in multi-adapter layers (`models/_lora.py`);
    # a request picks one by name (`Submit.adapter`). Given as NAME=PATH strings (a flag per
    # adapter, or one variable with commas) or, in the library, as a {name: path} mapping.
    adapters: tuple[str, ...] = field(default=(), metadata=doc(
        "named LoRA adapters served over the model side by side, each NAME=PATH (a directory as "
        "mlx_lm.lora writes it), the flag once per adapter; a request picks one by its model field "
        "(NAME or MODEL:NAME), rows of different adapters and of none share one batch; not with "
        "adapter_path or distributed", flag="adapter"))
    idle_release: float | None = field(default=None, metadata=doc(  # `Actor._idle`
        "seconds idle before the actor hands MLX's buffer cache back; unset: 1 on a GPU, never "
        "on the CPU; 0: never"))
    cache_limit_gb: float | None = field(default=None, metadata=doc(
        "the most freed-buffer memory (GB) MLX keeps for reuse; unset: MLX's own limit (on CUDA "
        "80 percent of the device per process), so set it where processes share a GPU"))
    prompt_cache_gb: float | None = field(default=None, metadata=doc(  # `_prompt_cache.py`
        "the most memory (GB) the prompt cache holds: the KV of earlier prompts and answers, "
        "reused by requests that start alike (a chat's next turn, a shared system prompt); "
        "least recently used entries go first, and all of it before a request would run out of "
        "memory; unset: a fifth of a GPU's memory, at most 1 GB on the CPU; 0: off"))
    prompt_cache_disk_gb: float = field(default=0.0, metadata=doc(  # `_disk_cache.py`
        "the most KV (GB) the prompt cache keeps on disk across restarts, under cache_dir/prompt-cache: "
        "written when the server stops cleanly (newest entries first), read back after warm-up; "
        "0: off; not with distributed"))
    step_trace: str | None = field(default=None, metadata=doc(  # `_trace.StepTrace`
        "append one tab-separated line per actor step (times, batch sizes) to this file, and one per "
        "completion request (arrival, intake, first token, end, tokens) to FILE.requests on the same "
        "clock; the other ranks of a distributed group append their steps to FILE.rankN on their own hosts"))

    def __post_init__(self) -> None:
        # Checked here, once, for the server and the library alike; a bad value stops a
        # server before it loads anything.
        object.__setattr__(self, "adapters", _adapter_entries(self.adapters))
        if self.adapters and self.adapter_path:
            raise ValueError("adapters and adapter_path do not combine: adapter_path applies one adapter to "
                             "every request, adapters let each request pick one (serve the one adapter as "
                             "NAME=PATH among the adapters instead)")
        if self.adapters and self.decode_step != "owned":
            raise ValueError("adapters need decode_step 'owned' (the actor's decode step selects each row's "
                             "adapter)")
        least = {"max_batch": 1, "prefill_batch": 1, "prefill_step": 1, "retire_steps": 0, "prefill_budget": 0,
                 "kv_group_size": 1, "quantized_kv_start": 0, "speculative_max_rows": 1}
        for name, low in least.items():
            value = getattr(self, name)
            if name == "prefill_budget" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be >= {low} (an integer), got {value!r}")
        for name in ("admit_window", "prompt_cache_disk_gb", "idle_release", "cache_limit_gb", "prompt_cache_gb"):
            value = getattr(self, name)
            if value is None and name not in ("admit_window", "prompt_cache_disk_gb"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be >= 0 (a finite number), got {value!r}")
        if self.decode_step not in ("owned", "mlx"):
            raise ValueError(f"decode_step must be 'owned' or 'mlx', got {self.decode_step!r}")
        if self.grammar_masks not in ("after", "before", "auto"):
            raise ValueError(f"grammar_masks must be 'after', 'before' or 'auto', got {self.grammar_masks!r}")
        if self.grammar_masks == "before" and self.decode_step != "owned":
            raise ValueError("grammar_masks 'before' needs decode_step 'owned' (mlx-lm's step fills each "
                             "row's mask in its own processor)")
        for name in ("num_draft_tokens", "ngram_size"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DRAFT:
                raise ValueError(f"{name} must be an integer from 1 to {MAX_DRAFT}, got {value!r}")
        if self.speculative not in (None, "ngram", "draft"):
            raise ValueError(f"speculative must be 'ngram' or 'draft', got {self.speculative!r}")
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("speculative 'draft' needs draft_model")
        if self.speculative == "ngram" and self.draft_model:
            raise ValueError("draft_model goes with speculative 'draft' (or unset), not 'ngram'")
        if self.kv_bits is not None:
            if isinstance(self.kv_bits, bool) or self.kv_bits not in KV_BITS:
                raise ValueError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))} (or unset), got {self.kv_bits!r}")
            if isinstance(self.kv_group_size, bool) or self.kv_group_size not in KV_GROUP_SIZES:
                raise ValueError(f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, "
                                 f"got {self.kv_group_size!r}")
            if self.quantized_kv_start != 0:
                raise ValueError(f"quantized_kv_start must be 0 (kv_bits quantizes a sequence's KV from its "
                                 f"first token: a row of a batch cannot change precision beside the others), "
                                 f"got {self.quantized_kv_start!r}")
        if self.speculation is not None and self.decode_step != "owned":
            raise ValueError("speculative decoding needs decode_step 'owned'")

    @property
    def speculation(self) -> str | None:
        """The speculative decoding in force: 'ngram', 'draft' (set, or implied by
        draft_model), or None."""
        return self.speculative or ("draft" if self.draft_model else None)

    @property
    def adapter_map(self) -> dict[str, str]:
        """The named adapters, {name: path}, in the order given (slot i + 1 each: slot 0 is none)."""
        return dict(entry.split("=", 1) for entry in self.adapters)  # type: ignore[misc]

    @property
    def draft_tokens(self) -> int:
        """Tokens drafted per speculative step: `num_draft_tokens`, or its default for the mode."""
        if self.num_draft_tokens is not None:
            return self.num_draft_tokens
        return 32 if self.speculation == "ngram" else 4

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> ActorTuning:
        """The tuning TRIO_MLX_* variables set, as a server would read them; `overrides` (typed)
        win over them. The library reads no environment unless asked so, here."""
        environ = os.environ if environ is None else environ
        return cls(**{**read_environ(dataclasses.fields(cls), environ, overrides), **overrides})
