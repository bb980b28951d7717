"""The share of its host that this process may use: CPUs (cpuset and CFS bandwidth quota) and
memory (the cgroup's limit), as a container started with `--cpus 0.5 --memory 1g`, a Slurm job or
an emulated host (scripts/emulate-cluster.sh --cpus) grants it.

`os.cpu_count()` sees the machine; `os.sched_getaffinity` sees a cpuset but not a quota. A rank
that sizes its thread pool from either on a host capped at half a core starts two threads that
fight for 50 ms of CPU in every 100 ms, so thread defaults and waiting policies read this module.
Both cgroup v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`, `memory.limit_in_bytes`) and v2
(`cpu.max`, `memory.max`) are read, along the process's whole cgroup path: a parent's limit binds
its children too.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned 64-bit value.
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class CpuShare:
    """What this process may use of its host's CPUs."""

    host_cpus: int  # logical CPUs of the machine (os.cpu_count)
    affinity_cpus: int  # CPUs this process may be scheduled on (cpuset, taskset, a launcher's binding)
    quota_cpus: float | None  # CFS bandwidth quota in CPUs (0.5 = half a core); None when unlimited

    @property
    def cpus(self) -> float:
        """The CPU time this process may use per second of wall time."""
        return min(float(self.affinity_cpus), self.quota_cpus) if self.quota_cpus else float(self.affinity_cpus)

    @property
    def threads(self) -> int:
        """Threads that can all run at once: the quota rounded up (half a core still needs one)."""
        return max(1, min(self.affinity_cpus, math.ceil(self.cpus - 1e-9)))

    @property
    def limited(self) -> bool:
        """Whether a cpuset or a quota holds this process below the machine's CPUs."""
        return self.cpus < self.host_cpus

    def describe(self) -> str:
        if self.quota_cpus is not None and self.quota_cpus < self.affinity_cpus:
            return f"{self.cpus:g} of {self.host_cpus} CPUs (cgroup quota)"
        if self.affinity_cpus < self.host_cpus:
            return f"{self.affinity_cpus} of {self.host_cpus} CPUs (affinity)"
        return f"{self.host_cpus} CPUs"


def _cgroup_paths(proc_cgroup: str) -> dict[str, str]:
    """Controller -> path of this process's cgroup, from /proc/self/cgroup ('' = the v2 hierarchy)."""
    paths: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    return paths


def _ancestors(base: Path, path: str) -> list[Path]:
    """base/path and each of its parents up to base, innermost first."""
    parts = [p for p in path.split("/") if p]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, ValueError):
        return None


def _v1_quota(base: Path, path: str) -> float | None:
    best = None
    for d in _ancestors(base, path):
        quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        if quota and period and quota.lstrip("-").isdigit() and period.isdigit() and int(quota) > 0 and int(period) > 0:
            share = int(quota) / int(period)
            best = share if best is None else min(best, share)
    return best


def _v2_quota(base: Path, path: str) -> float | None:
    best = None
    for d in _ancestors(base, path):
        text = _read(d / "cpu.max")
        if not text:
            continue
        fields = text.split()
        if len(fields) == 2 and fields[0] != "max" and fields[0].isdigit() and fields[1].isdigit() and int(fields[1]) > 0:
            share = int(fields[0]) / int(fields[1])
            best = share if best is None else min(best, share)
    return best


def quota_cpus(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> float | None:
    """The tightest CFS bandwidth quota along this process's cgroup path, in CPUs; None if none."""
    if proc_cgroup is None:
        proc_cgroup = _read(Path("/proc/self/cgroup")) or ""
    paths = _cgroup_paths(proc_cgroup)
    found = []
    for name, path in paths.items():
        if name in ("cpu", "cpu,cpuacct"):
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                if (root / mount).is_dir():
                    found.append(_v1_quota(root / mount, path))
                    break
    if "" in paths:
        v2_base = root if (root / "cgroup.controllers").exists() else root / "unified"
        found.append(_v2_quota(v2_base, paths[""]))
    found = [q for q in found if q is not None]
    return min(found) if found else None


def memory_limit_bytes(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> int | None:
    """The tightest cgroup memory limit along this process's path, in bytes; None if unlimited."""
    if proc_cgroup is None:
        proc_cgroup = _read(Path("/proc/self/cgroup")) or ""
    paths = _cgroup_paths(proc_cgroup)
    limits: list[int] = []
    if "memory" in paths and (root / "memory").is_dir():
        for d in _ancestors(root / "memory", paths["memory"]):
            text = _read(d / "memory.limit_in_bytes")
            if text and text.isdigit() and int(text) < _V1_UNLIMITED:
                limits.append(int(text))
    if "" in paths:
        v2_base = root if (root / "cgroup.controllers").exists() else root / "unified"
        for d in _ancestors(v2_base, paths[""]):
            text = _read(d / "memory.max")
            if text and text.isdigit():
                limits.append(int(text))
    return min(limits) if limits else None


def cpu_share() -> CpuShare:
    """This process's share of the host's CPUs, read now (cheap: a few small files)."""
    total = os.cpu_count() or 1
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else total
    return CpuShare(total, affinity, quota_cpus())


def usable_cpus() -> float:
    """The CPU time this process may use per second: min(cpuset/affinity, cgroup quota)."""
    return cpu_share().cpus
