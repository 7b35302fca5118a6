"""Tests for trio_mlx.models: resolving, converting, building and loading models.

Here loading and converting, in process; the rest: tests/unit/test_models.py and
tests/system/test_models.py.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest

from trio_mlx._errors import ModelLoadError
from trio_mlx.models import _cli, _models, _test_models

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def digest(directory: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir())}


# -- the embedded default ------------------------------------------------------------


@pytest.mark.slow
def test_embedded_default_answers_paris(embedded_model: Path) -> None:
    model, tokenizer = mlx_lm.load(str(embedded_model))
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=20)  # greedy by default
    assert "Paris" in text


@pytest.fixture(scope="module")
def packed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _models.ensure_embedded_model(tmp_path_factory.mktemp("packed"), dequantize=False)


def test_embedded_config_keeps_the_gguf_quantization(packed_model: Path) -> None:
    embedded_model = packed_model
    config = json.loads((embedded_model / "config.json").read_text())
    quant = config["quantization"]
    assert quant["model.embed_tokens"] == {"group_size": 32, "bits": 8}  # Q8_0 in the Q4_1 file
    assert quant["model.layers.29.mlp.down_proj"] == {"group_size": 32, "bits": 4}
    assert sum(k.startswith("model.layers.") for k in quant) == 30 * 7
    assert config["rope_traditional"] is True and config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == (1, 2, 49152)
    assert _models.context_length(config) == 8192
    weights = mx.load(str(embedded_model / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    assert "lm_head.weight" not in weights


def test_the_dequantized_variant_computes_what_the_packed_one_does(
    packed_model: Path, tmp_path: Path
) -> None:
    plain = _models.ensure_embedded_model(tmp_path, dequantize=True)
    assert plain.parent == tmp_path and plain.name != packed_model.name  # a variant of its own
    config = json.loads((plain / "config.json").read_text())
    assert "quantization" not in config
    weights = mx.load(str(plain / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.float32
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert not any(k.endswith((".scales", ".biases")) for k in weights)
    tokens = mx.array([[1, 9707, 28, 957, 314, 253, 2016, 30]])
    logits = [_models.load_model(p)[0](tokens) for p in (packed_model, plain)]
    assert mx.allclose(logits[0], logits[1], atol=1e-3).item()  # the same math, unpacked


def test_embedded_tokenizer_matches_smollm2(embedded_model: Path) -> None:
    tokenizer = _models.load_tokenizer(embedded_model)
    assert tokenizer.eos_token_ids == {2} and tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode(prompt)
    assert ids[0] == 1 and ids.count(2) == 2  # specials are single ids, no BOS added
    # Ids as SmolLM2's own tokenizer gives them (digits one by one, then the GPT-2 regex).
    assert tokenizer.encode("Hello world 12345 café") == [19556, 905, 216, 33, 34, 35, 36, 37, 37366]
    text = "naïve café ✓ 你好 <tab>\t\n  spaces"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_conversion_failure_half_way_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(metadata: object) -> dict[str, object]:  # runs after the weights were written
        raise RuntimeError("injected failure")

    monkeypatch.setattr(_models, "_gguf_tokenizer", boom)
    with pytest.raises(ModelLoadError, match="injected failure"):
        _models.ensure_embedded_model(tmp_path)
    assert list(tmp_path.iterdir()) == []  # no final dir, no partial one
    monkeypatch.undo()
    path = _models.ensure_embedded_model(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"


# -- resolve_model --------------------------------------------------------------------


def test_resolve_default_names_the_embedded_model(embedded_model: Path) -> None:
    for ref in (None, "", "default", _models.EMBEDDED_DEFAULT):
        assert _models.resolve_model(ref, cache_dir=embedded_model.parent) == embedded_model


def test_resolve_local_directories(tiny_model_fp32: Path, tmp_path: Path) -> None:
    assert _models.resolve_model(tiny_model_fp32) == tiny_model_fp32.resolve()
    assert _models.resolve_model(str(tiny_model_fp32)) == tiny_model_fp32.resolve()
    with pytest.raises(ModelLoadError, match="no config.json"):
        _models.resolve_model(tmp_path)
    for missing in (tmp_path / "nope", "./nope", "~/definitely/not/here/x", "a b/c"):
        with pytest.raises(ModelLoadError, match="no such model directory"):
            _models.resolve_model(missing)
    with pytest.raises(ModelLoadError, match="not a model directory"):
        _models.resolve_model(tiny_model_fp32 / "config.json")


# -- test models ------------------------------------------------------------------------


def test_tiny_builds_are_deterministic(tmp_path: Path) -> None:
    start = time.perf_counter()
    a = _test_models.build_test_model(tmp_path / "a", seed=7)
    assert time.perf_counter() - start < 2
    b = _test_models.build_test_model(tmp_path / "b", seed=7)
    c = _test_models.build_test_model(tmp_path / "c", seed=8)
    assert digest(a) == digest(b)
    assert set(digest(a)) == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert digest(a)["model.safetensors"] != digest(c)["model.safetensors"]
    assert digest(a)["tokenizer.json"] == digest(c)["tokenizer.json"]
    with pytest.raises(FileExistsError):
        _test_models.build_test_model(a)
    assert list(tmp_path.glob(".*")) == []  # no partial dirs left behind


def test_tiny_tokenizer_round_trips_and_renders_chatml(tiny_model_fp32: Path) -> None:
    tokenizer = _models.load_tokenizer(tiny_model_fp32)
    config = json.loads((tiny_model_fp32 / "config.json").read_text())
    assert len(tokenizer._tokenizer) == config["vocab_size"] == 512
    assert tokenizer.eos_token_ids == {2}
    for text in ("Hello, world! 12345", "naïve café ✓ 你好\n\ttabs", "What is the capital of France?"):
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert max(ids) < 512
    assert len(tokenizer.encode("The capital of France is Paris.")) < 12  # merges were learned
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True, tokenize=False,
    )
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(prompt)
    assert [ids[0], ids.count(1), ids.count(2)] == [1, 3, 2]
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_bf16_weights_really_are_bf16(tiny_model_bf16: Path, tiny_model_fp32: Path) -> None:
    for path, dtype in ((tiny_model_bf16, mx.bfloat16), (tiny_model_fp32, mx.float32)):
        weights = mx.load(str(path / "model.safetensors"))
        assert {w.dtype for w in weights.values()} == {dtype}
        model, _ = _models.load_model(path)
        assert model.model.layers[0].self_attn.q_proj.weight.dtype == dtype


def test_mlx_lm_loads_and_generates_on_the_tiny_model(tiny_model_fp32: Path) -> None:
    model, tokenizer = mlx_lm.load(str(tiny_model_fp32))
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    responses = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=12))
    tokens = [r.token for r in responses]
    assert len(tokens) == 12  # special rows are zero, so greedy never stops on EOS
    assert len(set(tokens)) > 3  # the layers, not the input embedding, pick tokens
    logits = model(mx.array([prompt]))[0, -1]
    assert logits[:3].tolist() == [0.0, 0.0, 0.0] and logits.max().item() > 0


def test_quantized_tiny_model(tmp_path: Path) -> None:
    path = _test_models.build_test_model(tmp_path / "q4", quantize_bits=4)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    model, config = _models.load_model(path)
    assert isinstance(model.model.layers[1].mlp.down_proj, nn.QuantizedLinear)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    logits = model(mx.array([[1, 40, 50]]))
    assert logits.shape == (1, 3, 512) and bool(mx.isfinite(logits).all())


def test_decode_step_at_batch_16_is_fast(tiny_model_fp32: Path) -> None:
    from mlx_lm.generate import BatchGenerator

    model, _ = _models.load_model(tiny_model_fp32)
    gen = BatchGenerator(model, max_tokens=100, completion_batch_size=16, prefill_batch_size=16)
    gen.insert([[1, 40 + i, 50, 60] for i in range(16)])
    times = []
    for _ in range(40):
        start = time.perf_counter()
        gen.next()
        times.append(time.perf_counter() - start)
    gen.close()
    # ~2 ms on a 2-core CPU; the bound is loose so a loaded machine does not flake.
    assert statistics.median(times[5:]) < 0.05


def test_spelled_padding_spells_a_bounded_range_and_greedy_decoding_stays_in_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only SPELLED padding ids become added tokens (llguidance reads them in quadratic
    time), and the weights silence the rest, so that greedy decoding samples the
    tokenizer's own ids and spelled ones, never an id whose text would not encode back."""
    monkeypatch.setitem(_test_models.SHAPES, "tiny", {**_test_models.SHAPES["tiny"], "vocab_size": 2048})
    monkeypatch.setattr(_models, "SPELLED", 256)
    path = _test_models.build_test_model(tmp_path / "m", spelled_padding=True)
    added = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    assert [t["id"] for t in added if t["content"].startswith("<|x")] == list(range(512, 768))
    model, tokenizer = mlx_lm.load(str(path))
    ids = tokenizer.encode(_models._CORPUS[:400])
    answer = []
    for _ in range(48):
        token = int(mx.argmax(model(mx.array([ids + answer]))[0, -1]).item())
        answer.append(token)
    assert max(answer) < 768 and min(answer) >= 3  # no silenced id, no special one
    assert any(t >= 512 for t in answer)  # the spelled ids are sampled
    spelled = [t for t in answer if t >= 512]
    assert tokenizer.encode(tokenizer.decode(spelled), add_special_tokens=False) == spelled


def test_a_random_model_can_take_a_real_models_tokenizer(
    tmp_path: Path, embedded_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`trio-mlx model build --tokenizer MODEL_DIR`: that model's tokenizer and chat template,
    a vocabulary its size and its bos and eos ids, so that the random model spells text (JSON
    for grammar benchmarks) as the real one does; its special tokens' rows are silent, so
    greedy decoding never stops on one."""
    out = tmp_path / "m"
    assert _cli.main(["build", str(out), "--tokenizer", str(embedded_model)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    real, tokenizer = _models.load_tokenizer(embedded_model), _models.load_tokenizer(out)
    real_config = json.loads((embedded_model / "config.json").read_text())
    assert config["vocab_size"] == len(real._tokenizer) == real_config["vocab_size"] == 49152
    assert (config["bos_token_id"], config["eos_token_id"]) == (real_config["bos_token_id"], real_config["eos_token_id"])
    text = '{"names": ["Ada", "Grace"], "n": 2}'
    assert tokenizer.encode(text) == real.encode(text)
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert ids == real.apply_chat_template(CHAT, add_generation_prompt=True)
    assert tokenizer.eos_token_ids == real.eos_token_ids
    specials = [t["id"] for t in json.loads((embedded_model / "tokenizer.json").read_text())["added_tokens"]
                if t["special"]]
    assert len(specials) > 2 and set(tokenizer.eos_token_ids) <= set(specials)
    model, _ = _models.load_model(out)
    logits = model(mx.array([ids]))[0, -1]
    assert logits[mx.array(specials)].tolist() == [0.0] * len(specials) and logits.max().item() > 0
    # taken as it is: not with the test tokenizer's options; a directory without one fails cleanly
    assert _cli.main(["build", str(tmp_path / "t"), "--tokenizer", str(embedded_model), "--tools"]) == 1
    assert "not with tools" in capsys.readouterr().err
    assert _cli.main(["build", str(tmp_path / "x"), "--tokenizer", str(tmp_path)]) == 1
    assert "no tokenizer to copy" in capsys.readouterr().err
    assert not (tmp_path / "t").exists() and not (tmp_path / "x").exists()
    # a tokenizer with no special token at all: nothing to silence
    plain = tmp_path / "plain"
    plain.mkdir()
    spec = json.loads((embedded_model / "tokenizer.json").read_text())
    spec["added_tokens"] = [{**t, "special": False} for t in spec["added_tokens"]]
    (plain / "tokenizer.json").write_text(json.dumps(spec))
    built = _test_models.build_test_model(tmp_path / "p", tokenizer=plain)
    config = json.loads((built / "config.json").read_text())
    assert config["vocab_size"] == 49152
    assert "eos_token_id" not in config and "bos_token_id" not in config  # no tokenizer_config.json names them


def test_load_errors_become_model_load_errors(tmp_path: Path, tiny_model_fp32: Path) -> None:
    for f in tiny_model_fp32.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ModelLoadError, match=f"could not load the model at '{tmp_path}'"):
        _models.load_model(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="could not load the tokenizer"):
        _models.load_tokenizer(tmp_path)


def test_cli(tmp_path: Path, embedded_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "built"
    assert _cli.main(["build", str(out), "--shape", "tiny", "--dtype", "bfloat16", "--bits", "8", "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 8
    assert _cli.main(["build", str(out)]) == 1
    assert "exists" in capsys.readouterr().err
    assert _cli.main(["default", "--cache-dir", str(embedded_model.parent)]) == 0
    assert capsys.readouterr().out.strip() == str(embedded_model)
