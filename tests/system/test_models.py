"""Tests for trio_mlx.models: resolving, converting, building and loading models.

Here conversions in processes that crash or race; the rest: tests/unit/test_models.py and
tests/integration/test_models.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trio_mlx._errors import ModelLoadError
from trio_mlx.models import _models

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, *args: str) -> subprocess.Popen[str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


# -- the embedded default ------------------------------------------------------------


def test_a_crash_mid_conversion_never_leaves_a_loadable_dir(tmp_path: Path) -> None:
    crash = (
        "import os, sys\n"
        "from trio_mlx.models import _models\n"
        "_models._gguf_tokenizer = lambda md: os._exit(3)\n"
        "_models.ensure_embedded_model(sys.argv[1])\n"
    )
    proc = run_python(crash, str(tmp_path))
    assert proc.wait(timeout=60) == 3, proc.stderr.read() if proc.stderr else ""
    [partial] = tmp_path.iterdir()
    assert partial.name.startswith(".") and partial.name.endswith(".partial")
    assert (partial / "model.safetensors").exists() and not (partial / "config.json").exists()
    with pytest.raises(ModelLoadError):
        _models.resolve_model(partial)
    old = time.time() - 3600
    os.utime(partial, (old, old))  # a stale leftover is swept by the next conversion
    path = _models.ensure_embedded_model(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_concurrent_conversions_agree_on_one_directory(tmp_path: Path) -> None:
    # Each process converts, then waits for the other before renaming, so one of
    # them always loses the rename race and must keep the winner's directory.
    code = (
        "import pathlib, sys, time\n"
        "from trio_mlx.models import _models\n"
        "cache, sync = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])\n"
        "convert = _models._convert_into\n"
        "def convert_then_wait(*args, **kwargs):\n"
        "    convert(*args, **kwargs)\n"
        "    (sync / sys.argv[3]).touch()\n"
        "    deadline = time.monotonic() + 30\n"
        "    while len(list(sync.iterdir())) < 2 and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "_models._convert_into = convert_then_wait\n"
        "print(_models.ensure_embedded_model(cache))\n"
    )
    cache, sync = tmp_path / "cache", tmp_path / "sync"
    sync.mkdir()
    procs = [run_python(code, str(cache), str(sync), name) for name in ("a", "b")]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sorted(p.name for p in sync.iterdir()) == ["a", "b"]  # both really converted
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1
    assert [str(p) for p in cache.iterdir()] == list(paths)  # and no partial dir is left
    assert json.loads((Path(paths.pop()) / "config.json").read_text())["model_type"] == "llama"
