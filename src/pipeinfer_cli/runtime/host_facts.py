"""This host as a profile's rank, a trace's machine and the memory check before loading see it:
name, CPU model, logical CPUs, the CPU this process may use, and memory (a cgroup's limit counted)."""

from __future__ import annotations

import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from .cpu_share import cpu_share, memory_limit_bytes


@dataclass(frozen=True)
class HostFacts:
    """This host, as a profile's rank records it (planner/profile.py `RankCosts`)."""

    host: str
    cpu: str  # the CPU model
    cores: int  # logical CPUs of the host
    usable_cpus: float  # what this process may use: the smaller of its affinity and a cgroup quota
    affinity_cpus: int
    quota_cpus: float | None
    mem_total_bytes: int
    mem_available_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)


def host_facts() -> HostFacts:
    """This host: name, CPU model, logical CPUs, the CPU this process may use (runtime/cpu_share.py:
    its affinity, a cgroup quota, and the smaller of them), total and available memory (bytes)."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                mem[key] = int(value.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    share = cpu_share()
    return HostFacts(socket.gethostname(), cpu or "unknown", share.host_cpus, share.cpus, share.affinity_cpus,
                     share.quota_cpus, mem.get("MemTotal", 0), _available(mem.get("MemAvailable", 0)))


def _available(mem_available: int) -> int:
    """MemAvailable, or less where a cgroup's memory limit (a container's, an emulated host's) holds
    this process below it: /proc/meminfo shows the machine's memory, not the limit."""
    limit = memory_limit_bytes()
    return mem_available if limit is None else min(mem_available, limit)
