"""How many CPUs this process may use: the sizes of the runtime's thread pools and worker
counts start from it (`engine/_limiters.py`, `engine/_grammar_pool.py`, `actor/_constrain.py`).

`os.cpu_count()` is the host's: a container held to 4 CPUs (a cgroup quota, as Docker's
`--cpus` and Kubernetes' CPU limits set) on a 128-core GPU host would size its pools for 128.
This takes the fewest of the host's CPUs, the affinity mask (`taskset`) and the cgroup's
quota (v2's `cpu.max`, v1's `cpu.cfs_quota_us` over `cpu.cfs_period_us`), as Rust's
`std::thread::available_parallelism` does (Python 3.13's `os.process_cpu_count` reads the
affinity alone)."""

from __future__ import annotations

import math
import os
from functools import cache

CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "QUOTA PERIOD" in microseconds, or "max PERIOD"
CFS = "/sys/fs/cgroup/cpu/cpu.cfs_{}_us"  # cgroup v1: quota (-1: none) and period, a file each


def quota_cpus(text: str) -> int | None:
    """The CPUs a cgroup quota allows, from "QUOTA PERIOD" (v2's `cpu.max` line, or v1's two
    files joined): the quota over the period, rounded up; None for no quota ("max", v1's
    "-1") or a line this cannot read."""
    parts = text.split()
    if len(parts) != 2 or parts[0] in ("max", "-1"):
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


@cache
def usable_cpus() -> int:
    """The CPUs this process may use (at least 1), read once."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        cpus = os.cpu_count() or 1
    quota = None
    try:
        with open(CPU_MAX) as f:
            quota = quota_cpus(f.read())
    except OSError:  # no cgroup v2: v1's two files, or none (macOS)
        try:
            with open(CFS.format("quota")) as q, open(CFS.format("period")) as p:
                quota = quota_cpus(f"{q.read().strip()} {p.read().strip()}")
        except OSError:
            pass
    return max(1, min(cpus, quota) if quota else cpus)
