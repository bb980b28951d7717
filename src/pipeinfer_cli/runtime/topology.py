"""The threads a rank computes with, from the CPU its host grants it (runtime/cpu_share.py): the
default of `--threads` (a fact the planner takes, planner/layout.py) and whether a rank's threads
have cores of their own.
"""

from __future__ import annotations

import math
import os

from .cpu_share import cpu_share


# Set by `generate --ranks N` for an iterative job on one machine (cli/generate_cmd.py): one stage
# computes at a time there, so each rank may use every CPU its host grants it, not a share of them.
WHOLE_HOST_ENV = "PIPEINFER_WHOLE_HOST_THREADS"


def default_threads(ranks_per_host: int, environ=os.environ) -> int:
    """This rank's thread count when --threads is not given, from the CPU it may actually use
    (runtime/cpu_share.py): a launcher's binding (affinity) is this rank's own; a cgroup quota (a
    container's --cpus, an emulated host's --cpus) is shared by the ranks on the host; otherwise
    the host's CPUs are divided among the ranks that share its name."""
    share = cpu_share()
    if environ.get(WHOLE_HOST_ENV) == "1":
        return share.threads
    if share.affinity_cpus < share.host_cpus:
        return share.threads  # the launcher bound this rank to its own CPUs (Slurm, mpirun --bind-to)
    if share.quota_cpus is not None:
        return max(1, math.ceil(share.cpus / max(1, ranks_per_host) - 1e-9))
    return max(1, share.host_cpus // max(1, ranks_per_host))


def alone_on_cores(threads_here: int, threads_mine: int) -> bool:
    """Whether a rank's threads have cores of their own: those of every process on its host
    (threads_here, a draft model's included) fit in the CPUs the host grants, or, for a rank the
    launcher bound to its own CPUs, its own threads (threads_mine) fit in them. Under a CPU quota
    only whole cores count: a rank held to half a core pays for every cycle it spins."""
    share = cpu_share()
    if share.affinity_cpus < share.host_cpus:
        return threads_mine <= math.floor(share.cpus + 1e-9)
    return threads_here <= math.floor(share.cpus + 1e-9)
