"""How many CPUs this process can really use: its affinity mask (taskset, a container's
cpuset) and its cgroup's CPU quota (docker --cpus, a Kubernetes limit), whichever is less.

os.cpu_count() sees every CPU of the host, and neither torch nor OpenMP reads a quota: a
container limited to 2 CPUs on a 64-CPU host would start 64 (or 32) spinning threads that
the kernel then throttles in 100 ms periods."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def affinity_cpus() -> frozenset[int] | None:
    """The CPUs this process may run on, or None where the OS does not say (macOS)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _v2_quota(path: Path) -> float | None:
    """cpu.max of one cgroup v2 folder: "max 100000" or "<quota> <period>"."""
    try:
        quota, period = path.joinpath("cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(path: Path) -> float | None:
    try:
        quota = int(path.joinpath("cpu.cfs_quota_us").read_text())
        period = int(path.joinpath("cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")
                     ) -> float | None:
    """CPUs' worth of time per period this process's cgroup (or an ancestor) allows, the
    tightest one; None when unlimited or unknown."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":  # cgroup v2: one unified hierarchy
            base, read = root, _v2_quota
        elif "cpu" in controllers.split(","):
            base, read = root / controllers, _v1_quota
            if not base.exists():
                base = root / "cpu"
        else:
            continue
        folder = base / rel.lstrip("/")
        while True:  # the cgroup and its ancestors up to the mount's root
            q = read(folder)
            if q is not None:
                limits.append(q)
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return min(limits) if limits else None


def usable_cores() -> int:
    """Whole CPUs this process can use: its affinity mask, capped by its CPU quota (rounded
    down: a thread that only gets part of a CPU stalls every parallel region; at least 1)."""
    cpus = affinity_cpus()
    n = len(cpus) if cpus else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    if quota is not None:
        n = min(n, max(1, math.floor(quota + 1e-6)))
    return max(1, n)
