"""The CPU path's OpenBLAS (`trio_mlx/models/_cpu_blas.py`): loaded under MLX when it can
be, the reference BLAS otherwise, and MLX's float32 matmuls right on both.

Here fresh processes; MLX imported first, in process: tests/unit/test_cpu_blas.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trio_mlx.models import _cpu_blas

ROOT = Path(__file__).resolve().parents[2]
CPU_WHEEL = sys.platform.startswith("linux") and _cpu_blas._has_dist("mlx-cpu")

# Imports trio_mlx.models first (that installs the BLAS), then MLX; prints what it saw.
PROBE = """
import ctypes, json, numpy as np
from trio_mlx import models
import mlx.core as mx
a = np.random.default_rng(0).standard_normal((96, 200), dtype=np.float32)
b = np.random.default_rng(1).standard_normal((200, 130), dtype=np.float32)
with mx.stream(mx.cpu):
    c = np.array(mx.array(a) @ mx.array(b))
status = models.cpu_blas_status()
print(json.dumps({"optimized": status.optimized, "description": status.description,
                  "error": float(np.abs(c - a @ b).max())}))
"""


def probe(tmp_path: Path, **env: str) -> dict[str, object]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    full = {**os.environ, "PYTHONPATH": path, "TRIO_MLX_CACHE_DIR": str(tmp_path), **env}
    out = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(not CPU_WHEEL, reason="OpenBLAS is loaded under MLX's Linux CPU wheel only")
def test_openblas_serves_mlx_matmuls(tmp_path: Path) -> None:
    seen = probe(tmp_path)
    assert seen["optimized"] is True, seen["description"]
    assert str(seen["description"]).startswith("OpenBLAS ") and "1 thread)" in str(seen["description"])
    assert float(seen["error"]) < 1e-3  # type: ignore[arg-type]
    assert list(tmp_path.glob("blas/*/libtrio_openblas.so"))  # made once, in the cache
    again = probe(tmp_path, OPENBLAS_NUM_THREADS="2", OPENBLAS_CORETYPE="Haswell")
    assert "Haswell kernels, chosen by OPENBLAS_CORETYPE=Haswell, 2 threads" in str(again["description"])


def test_the_reference_blas_when_asked(tmp_path: Path) -> None:
    seen = probe(tmp_path, TRIO_MLX_CPU_BLAS="reference")
    assert seen["optimized"] is False
    assert float(seen["error"]) < 1e-3  # type: ignore[arg-type]
    if CPU_WHEEL:
        assert seen["description"] == "reference BLAS (TRIO_MLX_CPU_BLAS=reference)"
        assert not (tmp_path / "blas").exists()


def test_a_failed_load_falls_back_to_the_reference_blas(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    not_a_library = tmp_path / "libscipy_openblas.so"
    not_a_library.write_text("not an ELF file")
    monkeypatch.setenv("TRIO_MLX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(_cpu_blas, "_status", None)
    monkeypatch.setattr(_cpu_blas, "_has_dist", lambda name: True)
    monkeypatch.setattr(_cpu_blas, "_openblas_library", lambda: not_a_library)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delitem(sys.modules, "mlx.core", raising=False)  # as if MLX were not loaded yet
    status = _cpu_blas.install()
    assert status.optimized is False
    assert status.description.startswith("reference BLAS (OpenBLAS failed to load:")
    assert _cpu_blas.install() is status  # decided once
    assert not list((tmp_path / "cache").glob("blas/*/*.so"))  # no half-made copy left
