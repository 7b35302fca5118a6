"""Several hypercorn workers would each load the model onto the same device: refused at startup with a
clear line and a non-zero exit, unless TRIO_MLX_ALLOW_MULTIPLE_WORKERS=1. The guard is a per-model/device
file lock. (The same refusal under the other ASGI servers: tests/system/test_asgi_servers.py.)

Here the lock's key and its sharing (with a probe process); server processes:
tests/system/test_workers.py.
"""

from __future__ import annotations

import subprocess
import sys

from processes import ENV

from trio_mlx.server import _workers
from trio_mlx.server._settings import Settings


def test_the_lock_is_per_model_and_device_and_shared_within_a_process(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    sa, sb = Settings(model=str(a)), Settings(model=str(b))
    assert _workers.lock_path(sa) != _workers.lock_path(sb)
    assert _workers.lock_path(Settings(model=str(a) + "/")) == _workers.lock_path(sa)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    other_device = _workers.lock_path(sa)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert _workers.lock_path(sa) != other_device
    # two apps in one process share the lock; another process is refused until both released it
    first, second = _workers.acquire(sa), _workers.acquire(sa)
    code = ("import sys; from trio_mlx.server import _workers; from trio_mlx.server._settings import Settings\n"
            "try:\n    _workers.acquire(Settings(model=sys.argv[1]))\nexcept _workers.AlreadyServing as e:\n"
            "    print(e); sys.exit(7)\n")
    probe = [sys.executable, "-c", code, str(a)]
    env = {**ENV, "CUDA_VISIBLE_DEVICES": "0"}
    assert subprocess.run(probe, env=env, capture_output=True, timeout=30).returncode == 7
    first.release()
    assert subprocess.run(probe, env=env, capture_output=True, timeout=30).returncode == 7
    second.release()
    done = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
