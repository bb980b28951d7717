"""Where Hydra's mpiexec puts the ranks of a `--ranks N` job when HYDRA_HOST_FILE names a
hostfile, and the one line that says so when a host gets more ranks than the hostfile gave it.

Hydra reads `HOST[:SLOTS]` lines (one slot without `:SLOTS`; `#` starts a comment) and gives each
host its slots' worth of consecutive ranks, in file order; past the last slot it starts again at
the first host. So `--ranks 5` on four hosts of one slot each puts ranks 0 and 4 on the first host,
where they share its cores and memory. A hostfile that gives a host two slots (`node01:2`) asks
for that, and is not warned about.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from .host_probe import HOSTFILE_ENV, ranks_on

# Set once the launching command has said it, so that the calibration it runs first (a command of
# its own, `calibrate --ranks N`) does not say it again.
SAID_ENV = "PIPEINFER_SHARED_HOSTS_SAID"


def read_hostfile(path: str | os.PathLike) -> list[tuple[str, int]] | None:
    """[(host, slots)] in file order; None when the file cannot be read or a line is not HOST[:SLOTS]
    (Open MPI's `HOST slots=N`, say: no warning is better than a wrong one)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        return None
    hosts = []
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        host, _, slots = words[0].partition(":")
        if len(words) > 1 or not host or (slots and not slots.isdigit()) or slots == "0":
            return None
        hosts.append((host, int(slots) if slots else 1))
    return hosts or None


def placement(hosts: list[tuple[str, int]], n_ranks: int) -> list[str]:
    """The host of each rank, as Hydra fills the slots (the module docstring; host_probe.ranks_on)."""
    return ranks_on([f"{host}:{slots}" for host, slots in hosts], n_ranks)


def shared_hosts_line(hosts: list[tuple[str, int]], n_ranks: int, path: str) -> str | None:
    """The warning when some host gets more ranks than its slots (None when none does)."""
    slots: Counter[str] = Counter()
    for host, k in hosts:
        slots[host] += k
    total = sum(slots.values())
    if n_ranks <= total:
        return None
    ranks = Counter(placement(hosts, n_ranks))
    over = [h for h in ranks if ranks[h] > slots[h]]
    named = ", ".join(f"{h} ({ranks[h]} ranks)" for h in over)
    fix = " ".join(f"{h}:{ranks[h]}" for h in over)
    return (f"pipeinfer: warning: {n_ranks} ranks on the {total} slots of the hostfile {path} ({HOSTFILE_ENV}): ranks "
            f"share a host's CPU and memory on {named}; pass --ranks {total}, or give {'that host' if len(over) == 1 else 'those hosts'} "
            f"as many slots ({fix}) to mean it")


def warn_shared_hosts(n_ranks: int, environ=os.environ) -> None:
    """The launching command of a `--ranks N` job: say, in one line on stderr, which hosts of
    HYDRA_HOST_FILE get more ranks than their slots (once per command, its calibration included)."""
    import sys

    path = environ.get(HOSTFILE_ENV)
    if not path or n_ranks < 2 or environ.get(SAID_ENV):
        return
    hosts = read_hostfile(path)
    line = shared_hosts_line(hosts, n_ranks, path) if hosts else None
    if line is not None:
        print(line, file=sys.stderr, flush=True)
        environ[SAID_ENV] = "1"
