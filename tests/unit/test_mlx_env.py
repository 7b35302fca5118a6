"""MLX's settings from the environment (`trio_mlx/models/_mlx_env.py`): the runtime's default
where the user set none, the user's value where they did."""

from __future__ import annotations

import os

import pytest

import trio_mlx.models  # noqa: F401  (installs the defaults at import)
from trio_mlx.models import _mlx_env


def test_the_graph_cache_default_is_set_where_nothing_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLX_CUDA_GRAPH_CACHE_SIZE", raising=False)
    _mlx_env.install()
    assert os.environ["MLX_CUDA_GRAPH_CACHE_SIZE"] == "1000"


def test_a_users_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_CUDA_GRAPH_CACHE_SIZE", "64")
    _mlx_env.install()
    assert os.environ["MLX_CUDA_GRAPH_CACHE_SIZE"] == "64"


def test_importing_the_models_package_installed_them() -> None:
    # conftest and this module imported `trio_mlx.models` before any test ran
    assert os.environ.get("MLX_CUDA_GRAPH_CACHE_SIZE") is not None
