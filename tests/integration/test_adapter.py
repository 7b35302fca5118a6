"""A LoRA adapter served over the base model (`adapter_path`, `--adapter-path`), on the tiny fp32 model.

The adapter is made here as mlx_lm.lora writes one (adapter_config.json, adapters.safetensors
holding the LoRA layers' trainable weights), with random non-zero weights so that it changes
the output. The served greedy tokens must be mlx-lm's own with the same adapter loaded
(`mlx_lm.load(..., adapter_path=...)`), in the thread and the process actor alike.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from app_server import serve
from processes import ENV, SERVE

import trio_mlx
from trio_mlx import ModelLoadError
from trio_mlx.actor import _disk_cache
from trio_mlx.server._settings import Settings

from .test_engine import reference_greedy, run

PROMPT = "The quick brown fox jumps over the lazy dog"
TOKENS = 16


def _make_adapter(model_path: Path, where: Path, *, rank: int = 4, layers: int | None = None, seed: int = 7,
                  keys: list[str] | None = None, kind: str = "lora") -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map_with_path
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(model_path)
    model.freeze()
    num_layers = len(model.layers) if layers is None else layers
    params: dict[str, Any] = {"rank": rank, "dropout": 0.0, "scale": 2.0, **({"keys": keys} if keys else {})}
    mx.random.seed(seed)  # before the conversion, which draws lora_a: the same adapter in every run
    linear_to_lora_layers(model, num_layers, params, use_dora=kind == "dora")
    # lora_b starts at zero (the adapter a no-op): random weights make it change the output
    model.update(tree_map_with_path(
        lambda name, w: mx.random.normal(w.shape) * 0.2 if name.endswith("lora_b") else w,
        model.trainable_parameters()))
    where.mkdir(parents=True)
    mx.save_safetensors(str(where / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    (where / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": kind, "num_layers": num_layers, "lora_parameters": params}))
    return where


@pytest.fixture(scope="module")
def adapter(tiny_model_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_adapter(tiny_model_fp32, tmp_path_factory.mktemp("lora") / "adapter")


def mlx_lm_greedy(model_path: Path, adapter_path: Path, prompt_ids: list[int], n: int) -> list[int]:
    """mlx-lm's own generation with the adapter loaded by mlx-lm's own `load`."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(model_path), adapter_path=str(adapter_path))
    return [int(tok) for tok, _ in generate_step(mx.array(prompt_ids), model, max_tokens=n)]


@pytest.mark.parametrize("actor", ["thread", "process"])
async def test_adapted_greedy_tokens_are_mlx_lm_s_and_not_the_base_model_s(tiny_model_fp32, adapter, actor):
    async with trio_mlx.open_engine(tiny_model_fp32, adapter_path=str(adapter), actor=actor) as engine:
        ids = engine.encode_prompt("text", PROMPT)
        got, _, fin = await run(engine, PROMPT, max_tokens=TOKENS, temperature=0, ignore_eos=True)
        # again: the second one may come from the prompt cache, which must hold the adapted KV
        again, _, _ = await run(engine, PROMPT, max_tokens=TOKENS, temperature=0, ignore_eos=True)
    expected = mlx_lm_greedy(tiny_model_fp32, adapter, ids, TOKENS)
    assert got == expected
    assert again == expected
    assert fin.usage.completion_tokens == TOKENS
    assert got != reference_greedy(tiny_model_fp32, ids, TOKENS), "the adapter changed nothing"


async def test_a_missing_adapter_directory_fails_startup_naming_it(tiny_model_fp32, tmp_path):
    missing = tmp_path / "no-such-adapter"
    with pytest.raises(ModelLoadError, match="no-such-adapter.*no such directory"):
        async with trio_mlx.open_engine(tiny_model_fp32, adapter_path=str(missing)):
            pass


async def test_a_folder_without_adapter_files_fails_startup_naming_them(tiny_model_fp32, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="not an adapter directory.*adapters.safetensors"):
        async with trio_mlx.open_engine(tiny_model_fp32, adapter_path=str(tmp_path)):
            pass


async def test_an_adapter_for_another_shape_fails_startup_with_mlx_lm_s_reason(tiny_model_fp32, adapter, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "adapters.safetensors").write_bytes((adapter / "adapters.safetensors").read_bytes())
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["lora_parameters"]["rank"] = 8  # the file's weights have rank 4
    (other / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"(?s)could not apply the adapter at .*other.*does not match.*and 25 more"):
        with trio.fail_after(30):
            async with trio_mlx.open_engine(tiny_model_fp32, adapter_path=str(other), warmup=False):
                pass


def test_the_disk_cache_keeps_an_adapted_model_apart(tiny_model_fp32, adapter, tmp_path):
    base = _disk_cache.folder(tmp_path, tiny_model_fp32)
    assert _disk_cache.folder(tmp_path, tiny_model_fp32, adapter) != base
    assert _disk_cache.folder(tmp_path, tiny_model_fp32, adapter) == _disk_cache.folder(
        tmp_path, tiny_model_fp32, adapter)


def test_settings_take_the_flag_s_variable_and_refuse_it_distributed():
    assert Settings.from_env({"TRIO_MLX_ADAPTER_PATH": "/a/b"}).tuning.adapter_path == "/a/b"
    with pytest.raises(ValueError, match="adapter_path needs a single rank"):
        Settings.from_env({}, adapter_path="/a/b", distributed="tensor")


async def test_the_model_card_and_server_info_name_the_adapter(tiny_model_fp32, adapter):
    async with serve(tiny_model_fp32, adapter_path=str(adapter)) as srv:
        async with httpx.AsyncClient(base_url=srv.url) as client:
            card = (await client.get("/v1/models")).json()["data"][0]
            info = (await client.get("/server_info")).json()
    assert card["adapter"] == info["adapter_path"] == str(adapter)
    assert card["id"] == "model" and card["root"] == str(tiny_model_fp32)  # the served name stays the model's


def test_serve_with_a_missing_adapter_exits_1_naming_it(tiny_model_fp32, tmp_path):
    missing = tmp_path / "no-such-adapter"
    proc = subprocess.run([*SERVE, str(tiny_model_fp32), "--adapter-path", str(missing), "--port", "0",
                           "--no-warmup", "--actor", "thread"], capture_output=True, text=True, timeout=60, env=ENV)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "could not start" in proc.stderr and f"adapter {str(missing)!r}: no such directory" in proc.stderr
    assert "Traceback" not in proc.stderr
