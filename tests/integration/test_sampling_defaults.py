"""Sampling defaults: a request that leaves temperature, top_p, top_k, min_p or
repetition_penalty out samples with the model's generation_config.json (as vLLM does);
its own values always win. The embedded default ships greedy decoding, so the README's
first request answers "Paris" without a temperature.

Here /v1/models and the embedded default; what the engine submits:
tests/unit/test_sampling_defaults.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from app_server import CHAT, serve

from trio_mlx.models import _models

MODEL_DEFAULTS = {"temperature": 0.2, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1}


@pytest.fixture
def tuned_model(tiny_model_fp32: Path, tmp_path: Path) -> Path:
    path = Path(shutil.copytree(tiny_model_fp32, tmp_path / "tuned"))
    (path / "generation_config.json").write_text(json.dumps({"do_sample": True, **MODEL_DEFAULTS}))
    return path


async def test_models_lists_its_sampling_defaults_and_none_turns_them_off(tuned_model: Path) -> None:
    async with serve(tuned_model) as server, server.client() as client:
        card = (await client.get("/v1/models")).json()["data"][0]
        assert card["sampling_defaults"] == MODEL_DEFAULTS
    async with serve(tuned_model, generation_config="none") as server, server.client() as client:
        card = (await client.get("/v1/models")).json()["data"][0]
        assert card["sampling_defaults"] == {}
        assert server.engine.sampling_defaults == {}


def test_the_embedded_default_ships_greedy_sampling(embedded_model: Path) -> None:
    assert _models.sampling_defaults(embedded_model) == {"temperature": 0.0}


@pytest.mark.slow
async def test_the_readmes_first_request_answers_paris(embedded_model: Path) -> None:
    # README.md's first curl, word for word: no temperature, streamed, 32 tokens.
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32, "stream": True}
    async with serve(embedded_model) as server, server.client(timeout=60) as client:
        for _ in range(3):  # every answer, not one in three
            text = []
            async with client.stream("POST", CHAT, json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        text += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
            assert "Paris" in "".join(text), "".join(text)
