"""Random-weight test models: llamas of a few shapes with the test tokenizer (`_models.py`
trains and writes it) or a real model's tokenizer, deterministic from a seed, for tests and
benchmarks (`trio-mlx model build`). Built beside their final name and renamed into place,
as every model directory is (`_models._atomic_dir`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import shutil
from typing import Any

import mlx.core as mx

from .._errors import ModelLoadError
from ._models import (
    _SPECIALS,
    _TOOL_TOKENS,
    CHATML_TEMPLATE,
    TOOLS_TEMPLATE,
    _atomic_dir,
    _train_tokenizer,
    _write_json,
    _write_tokenizer,
)

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                 rope_theta=10000.0, max_position_embeddings=1024),
    # "tiny" with a head dim of 64, which every quantized KV group size divides (kv_bits)
    "tiny-hd64": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=256, vocab_size=512,
                      rope_theta=10000.0, max_position_embeddings=1024),
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                         rope_theta=100000.0, max_position_embeddings=8192),
    # The real model allows 131072 positions; 8192 is plenty for benchmarks.
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                         head_dim=64, rope_theta=500000.0, max_position_embeddings=8192,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}),
    # The Llama-3.1-8B shape, for comparisons across GPUs and of a model sharded over them.
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                         head_dim=128, rope_theta=500000.0, max_position_embeddings=8192,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}),
}


def model_config_for_shape(shape: str, *, dtype: str = "float32") -> dict[str, Any]:
    """The config.json that build_test_model writes for `shape` (before quantizing)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unsupported dtype {dtype!r}")
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], **SHAPES[shape],
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "rope_traditional": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": dtype,  # see _SPECIALS
    }


def _write_test_tokenizer(
    out: pathlib.Path, *, vocab_size: int, model_max_length: int, tools: bool = False,
    spelled_padding: bool = False,
) -> int:
    from tokenizers import AddedToken

    extra = _TOOL_TOKENS if tools else []
    tokenizer = _train_tokenizer(min(vocab_size, 512) - len(extra))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra])
    return _write_tokenizer(
        out, tokenizer=tokenizer, chat_template=TOOLS_TEMPLATE if tools else CHATML_TEMPLATE,
        bos="<|im_start|>", eos="<|im_end|>", unk="<|endoftext|>", pad="<|endoftext|>",
        model_max_length=model_max_length, vocab_size=vocab_size, spelled_padding=spelled_padding,
    )


def build_test_model(
    out_dir: os.PathLike[str], *, shape: str = "tiny", dtype: str = "float32", seed: int = 0,
    quantize_bits: int | None = None, tools: bool = False, spelled_padding: bool = False,
    tokenizer: os.PathLike[str] | None = None,
) -> pathlib.Path:
    """Write a deterministic random-weight llama (real BPE tokenizer, ChatML) to `out_dir`.
    With `tools`, its chat template renders tools and tool calls (`TOOLS_TEMPLATE`); with
    `spelled_padding`, the ids past the tokenizer's own (which a random model samples)
    encode back from their text (`_write_tokenizer`). With `tokenizer` (a model directory),
    that model's tokenizer and chat template instead of the test tokenizer, and a vocabulary
    its size (`_copy_tokenizer`)."""
    config = model_config_for_shape(shape, dtype=dtype)
    if quantize_bits not in (None, 4, 8):
        raise ValueError(f"quantize_bits must be None, 4 or 8, not {quantize_bits!r}")
    if tokenizer is not None and (tools or spelled_padding):
        raise ValueError("a copied tokenizer is taken as it is: not with tools or spelled_padding")
    final = pathlib.Path(out_dir)
    with _atomic_dir(final, exist_ok=False) as tmp:
        positions = config["max_position_embeddings"]
        silent: list[int] = list(range(len(_SPECIALS)))
        if tokenizer is None:
            sampled = _write_test_tokenizer(tmp, vocab_size=config["vocab_size"], model_max_length=positions,
                                            tools=tools, spelled_padding=spelled_padding)
        else:
            sampled, silent, ids = _copy_tokenizer(pathlib.Path(tokenizer), tmp)
            del config["bos_token_id"], config["eos_token_id"]  # the test tokenizer's; the copy's where it names them
            config.update(vocab_size=sampled, **ids)
        config = _write_random_weights(tmp, config, seed=seed, bits=quantize_bits, sampled=sampled, silent=silent)
        _write_json(tmp / "config.json", config)
    return final


# What `_copy_tokenizer` takes from a model directory: the tokenizer and its chat template
# (inside tokenizer_config.json, or a file of its own). Not generation_config.json: its
# sampling defaults are the real model's, not a random one's.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "chat_template.json")


def _copy_tokenizer(source: pathlib.Path, out: pathlib.Path) -> tuple[int, list[int], dict[str, int]]:
    """Copy `source`'s tokenizer into `out`: a random model that tokenizes as a real one does
    (the test tokenizer's 512 tokens spell JSON a byte a token, ~3x a real tokenizer's tokens,
    which makes grammar benchmarks dearer than a real model's). Returns the vocabulary's size
    (the model's), the special tokens' ids (their embedding rows are zeroed, so that greedy
    decoding never stops on one, as with the test tokenizer) and the config's bos and eos ids.
    Raises ModelLoadError for a directory without a fast tokenizer."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    except Exception as exc:
        raise ModelLoadError(f"no tokenizer to copy at {str(source)!r} (a tokenizer.json): {exc}") from exc
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    config = source / "tokenizer_config.json"
    settings = json.loads(config.read_text()) if config.is_file() else {}
    ids = {}
    for key in ("bos_token", "eos_token"):
        token = settings.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and (i := tokenizer.token_to_id(token)) is not None:
            ids[f"{key}_id"] = i
    specials = sorted(i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special)
    return tokenizer.get_vocab_size(with_added_tokens=True), specials, ids


def _write_random_weights(
    out: pathlib.Path, config: dict[str, Any], *, seed: int, bits: int | None, sampled: int,
    silent: list[int],
) -> dict[str, Any]:
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import llama
    from mlx_lm.utils import quantize_model

    dtype = getattr(mx, config["torch_dtype"])
    model: Any = llama.Model(llama.ModelArgs.from_dict(config))  # its own init stays lazy
    params: Any = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for (name, param), key in zip(params, keys, strict=True):
        if name.endswith("norm.weight"):
            value = mx.ones(param.shape, dtype=dtype)
        else:  # 1/sqrt(fan_in) keeps each layer's output near unit scale (finite in
            # bf16) and lets the layers, not the input embedding, pick the next token.
            scale = 0.02 if "embed" in name else param.shape[-1] ** -0.5
            value = mx.random.normal(param.shape, dtype=dtype, scale=scale, key=key)
        if name == "model.embed_tokens.weight":
            # Zero rows give the special tokens (`silent`) logit 0 against ~500 random
            # ones, so greedy decoding never stops on EOS by chance: max_tokens is exact;
            # so it never samples the ids from `sampled` on either (see _write_tokenizer).
            value[mx.array(silent, dtype=mx.int32)] = 0  # typed: a tokenizer may have no special token
            value[sampled:] = 0
        mx.eval(value)  # one tensor at a time keeps the peak low for the big shapes
        new.append((name, value))
    model.update(tree_unflatten(new))
    if bits is not None:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints bits per weight
            model, config = quantize_model(model, config, group_size=64, bits=bits)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return config
