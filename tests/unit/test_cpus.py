"""The CPUs the runtime sizes its pools by (`trio_mlx/_cpus.py`): a cgroup's quota counts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trio_mlx import _cpus


@pytest.mark.parametrize(("line", "cpus"), [
    ("max 100000\n", None),  # no quota
    ("-1 100000", None),  # cgroup v1's "no quota"
    ("400000 100000\n", 4),  # docker --cpus 4
    ("150000 100000\n", 2),  # 1.5 CPUs: a second one partly
    ("50000 100000\n", 1),  # half a CPU: still one
    ("", None),
    ("garbage here\n", None),
])
def test_a_cgroup_quota_reads_as_cpus(line: str, cpus: int | None) -> None:
    assert _cpus.quota_cpus(line) == cpus


def test_the_usable_cpus_are_the_fewest_of_affinity_and_quota(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container held to 1 CPU on a bigger host sizes its pools for 1, not the host's count;
    without a quota file, the affinity mask alone."""
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("100000 100000\n")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(_cpus, "CPU_MAX", str(cpu_max))
    _cpus.usable_cpus.cache_clear()
    try:
        assert _cpus.usable_cpus() == 1
        _cpus.usable_cpus.cache_clear()
        monkeypatch.setattr(_cpus, "CPU_MAX", str(tmp_path / "absent"))
        monkeypatch.setattr(_cpus, "CFS", str(tmp_path / "cfs_{}"))
        (tmp_path / "cfs_quota").write_text("300000\n")  # cgroup v1: 3 CPUs
        (tmp_path / "cfs_period").write_text("100000\n")
        assert _cpus.usable_cpus() == 3
        _cpus.usable_cpus.cache_clear()
        (tmp_path / "cfs_quota").unlink()
        assert _cpus.usable_cpus() == 64
    finally:
        _cpus.usable_cpus.cache_clear()
