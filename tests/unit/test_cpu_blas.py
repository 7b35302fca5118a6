"""The CPU path's OpenBLAS (`trio_mlx/models/_cpu_blas.py`): loaded under MLX when it can
be, the reference BLAS otherwise, and MLX's float32 matmuls right on both.

Here the case of MLX imported first, in process; fresh processes: tests/system/test_cpu_blas.py.
"""

from __future__ import annotations

import sys

import pytest

from trio_mlx.models import _cpu_blas


def test_mlx_imported_first_keeps_the_reference_blas(monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core  # noqa: F401  (the case: MLX is already loaded)

    monkeypatch.setattr(_cpu_blas, "_status", None)
    monkeypatch.setattr(_cpu_blas, "_has_dist", lambda name: True)
    monkeypatch.setattr(sys, "platform", "linux")
    status = _cpu_blas.install()
    assert (status.optimized, status.description) == (
        False, "reference BLAS (mlx was imported before trio_mlx.models)")
