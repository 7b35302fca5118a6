"""A rank learns its place in a distributed group from the launcher's variables, without MLX
(actor/_group.py): the process's main thread decides from it whether to serve HTTP or follow,
and only the thread that uses the group joins it. What `mlx.launch` sets, per backend, is
read off MLX's launcher (mlx/_distributed_utils/launch.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trio_mlx.actor._group import GroupError, env_backend, launched

LAUNCH_VARS = ("MLX_", "NCCL_", "OMPI_", "PMI_")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    import os

    for key in list(os.environ):
        if key.startswith(LAUNCH_VARS):
            monkeypatch.delenv(key)
    return monkeypatch


def test_ring_rank_and_size_come_from_the_hostfile(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"], ["127.0.0.1:5002"]]))
    clean_env.setenv("MLX_HOSTFILE", str(hosts))
    clean_env.setenv("MLX_RANK", "2")
    assert env_backend() == "ring"
    assert launched() == (2, 3, "ring")
    assert launched("ring") == (2, 3, "ring")


def test_nccl_jaccl_and_mpi(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("NCCL_HOST_IP", "10.0.0.1")
    clean_env.setenv("NCCL_PORT", "12345")
    clean_env.setenv("MLX_WORLD_SIZE", "2")
    clean_env.setenv("MLX_RANK", "1")
    assert launched() == (1, 2, "nccl")
    for key in ("NCCL_HOST_IP", "NCCL_PORT", "MLX_WORLD_SIZE"):
        clean_env.delenv(key)
    devices = tmp_path / "devices.json"
    devices.write_text(json.dumps([[None, "rdma_en2"], ["rdma_en2", None]]))
    clean_env.setenv("MLX_IBV_DEVICES", str(devices))
    clean_env.setenv("MLX_JACCL_COORDINATOR", "10.0.0.1:5000")
    assert launched() == (1, 2, "jaccl")
    for key in ("MLX_IBV_DEVICES", "MLX_JACCL_COORDINATOR", "MLX_RANK"):
        clean_env.delenv(key)
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "4")
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "3")
    assert launched() == (3, 4, "mpi")


def test_outside_a_group_of_two_or_more_is_a_clear_error(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(GroupError, match="mlx.launch"):
        launched()
    hosts = tmp_path / "hosts.json"
    hosts.write_text("")  # what mlx.launch writes for a single rank
    clean_env.setenv("MLX_HOSTFILE", str(hosts))
    clean_env.setenv("MLX_RANK", "0")
    with pytest.raises(GroupError, match="at least 2 ranks"):
        launched()
    clean_env.delenv("MLX_RANK")
    with pytest.raises(GroupError, match="MLX_RANK is not set"):
        launched("ring")
    clean_env.setenv("MLX_RANK", "5")
    hosts.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    with pytest.raises(GroupError, match="outside a group of 2"):
        launched()


def test_reading_the_rank_loads_no_mlx(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    code = ("import sys; from trio_mlx.engine._distributed import launched; print(launched()); "
            "print([m for m in sys.modules if m.startswith('mlx')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env={"PATH": "/usr/bin:/bin", "MLX_HOSTFILE": str(hosts), "MLX_RANK": "1",
                              "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.stdout.splitlines() == ["(1, 2, 'ring')", "[]"], out.stdout + out.stderr
