"""Several hypercorn workers would each load the model onto the same device: refused at startup with a
clear line and a non-zero exit, unless TRIO_MLX_ALLOW_MULTIPLE_WORKERS=1. The guard is a per-model/device
file lock. (The same refusal under the other ASGI servers: tests/system/test_asgi_servers.py.)

Here the lock's key and its sharing (with a probe process); server processes:
tests/system/test_workers.py.
"""

from __future__ import annotations

import json
import os
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


def test_replicas_of_one_model_on_one_device_hold_locks_of_their_own(tmp_path, monkeypatch):
    """Replicas behind a router may share a device: each named (`--replica`) holds its own lock, a
    second server of the same name is refused, and an unnamed server keeps the lock it always had."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    plain = Settings(model=str(tmp_path))
    one, two = Settings(model=str(tmp_path), replica="1"), Settings(model=str(tmp_path), replica="2")
    assert len({_workers.lock_path(s) for s in (plain, one, two)}) == 3
    assert _workers.lock_path(Settings(model=str(tmp_path), replica="1")) == _workers.lock_path(one)
    assert _workers.model_key(plain) == json.dumps([f"path:{os.path.realpath(tmp_path)}", "0"])
    held = _workers.acquire(one)
    try:
        code = ("import sys; from trio_mlx.server import _workers; from trio_mlx.server._settings import Settings\n"
                "try:\n    _workers.acquire(Settings(model=sys.argv[1], replica=sys.argv[2]))\n"
                "except _workers.AlreadyServing as e:\n    print(e); sys.exit(7)\n")
        env = {**ENV, "CUDA_VISIBLE_DEVICES": "0"}
        same = subprocess.run([sys.executable, "-c", code, str(tmp_path), "1"], env=env, capture_output=True,
                              text=True, timeout=30)
        assert same.returncode == 7 and "as replica '1'" in same.stdout and "--replica NAME" in same.stdout
        other = subprocess.run([sys.executable, "-c", code, str(tmp_path), "2"], env=env, capture_output=True,
                               text=True, timeout=30)
        assert other.returncode == 0, other.stdout + other.stderr
    finally:
        held.release()
