"""What the actor loads beside its model, and checks against it: the quantized KV cache's
settings and speculative decoding's drafter (with its draft model). Called by `Actor._load`
on the actor's thread."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from .. import models
from ._batch import plain_kv
from ._drafting import Drafter
from ._kv_quant import RowQuantizedKVCache, attend_dequantized, check_kv_bits
from ._spec_step import speculative_step
from ._tuning import ActorTuning

log = logging.getLogger("trio_mlx.actor")


def kv_quantization(model: Any, config: dict[str, Any], tuning: ActorTuning) -> tuple[int, int] | None:
    """`(group_size, bits)` of the quantized KV cache (`kv_bits`, `_kv_quant.py`), or None;
    raises ValueError where the model cannot take it: a cache other than plain KV per
    layer, a group size that does not divide its head dim, bits the device does not run,
    an attention that fails on quantized keys (one token through the model says)."""
    if tuning.kv_bits is None:
        return None
    if not plain_kv(model):
        raise ValueError("kv_bits needs a model whose cache is a plain KV cache per layer (this one uses "
                         "rotating, chunked or state-space caches): unset kv_bits")
    heads = int(config.get("num_attention_heads") or 0)
    head_dim = int(config.get("head_dim") or (int(config.get("hidden_size") or 0) // heads if heads else 0))
    if head_dim <= 0:
        raise ValueError("kv_bits: the model's config.json gives no head dim (head_dim, or hidden_size "
                         "and num_attention_heads)")
    if mx.cuda.is_available():
        attend_dequantized()  # CUDA's quantized matmul lacks the attention's shapes (its docstring)
    check_kv_bits(tuning.kv_bits, tuning.kv_group_size, (head_dim,))
    try:  # one token through the model: its attention must take mlx-lm's quantized path
        caches = [RowQuantizedKVCache(tuning.kv_group_size, tuning.kv_bits) for _ in make_prompt_cache(model)]
        mx.eval(model(mx.array([[0]]), cache=caches))
    except Exception as exc:
        raise ValueError(f"kv_bits: this model does not run with a quantized KV cache (its attention must go "
                         f"through mlx-lm's scaled_dot_product_attention): {type(exc).__name__}: {exc}") from exc
    log.info("KV cache quantized: %d bits in groups of %d", tuning.kv_bits, tuning.kv_group_size)
    return tuning.kv_group_size, tuning.kv_bits


def load_drafter(model: Any, tuning: ActorTuning, draft_model_path: Any, vocab: int) -> Drafter | None:
    """Speculative decoding's drafter, if the tuning asks for one (`_drafting.py`), with
    its draft model loaded. Both models' caches must be plain KV caches (`plain_kv`):
    a rejected draft's KV is trimmed off, which a rotating or state-space cache cannot do."""
    mode = tuning.speculation
    if mode is None:
        return None
    if not plain_kv(model):
        raise ValueError("speculative decoding needs a model whose cache is a plain KV cache per layer "
                         "(rejected drafts are trimmed off it)")
    draft = None
    if mode == "draft":
        path = draft_model_path or tuning.draft_model
        assert path is not None
        t0 = time.perf_counter()
        draft, _ = models.load_model(Path(path))
        if not plain_kv(draft):
            raise ValueError(f"the draft model at {path} needs a plain KV cache per layer")
        log.info("loaded the draft model %s in %.2f s", path, time.perf_counter() - t0)
    log.info("speculative decoding: %s, up to %d drafted tokens a step, in batches of up to %d rows",
             "prompt lookup" if draft is None else "a draft model", tuning.draft_tokens, tuning.speculative_max_rows)
    return Drafter(tuning.draft_tokens, tuning.ngram_size, draft, vocab, tuning.prefill_step,
                   tuning.speculative_max_rows, speculative_step)
