"""The one emulated-cluster fixture every benchmark runs its jobs on (cluster/, the code of
scripts/emulate-cluster.sh): a fresh cluster up for a block and down after it, even on Ctrl-C; the
one place that enters a host; a campaign's exit status on Ctrl-C or a cluster that cannot be set up.

    with emulated_cluster("pi-cl", "10.214.0.0/24", 4, "1gbit", cpus="0.5") as c:
        job = run_json(cmd, out, c.env())
"""

from __future__ import annotations

import contextlib
import shlex
import signal
from collections.abc import Iterator

from benchmarks.runner import log
from cluster.cgroups import CgroupError
from cluster.hosts import Cluster, Failure, require_root  # noqa: F401  (what the benchmarks use of it)


def stop_signals_interrupt() -> None:
    """SIGTERM and SIGHUP end the campaign as Ctrl-C does, so that its cluster is taken down."""
    def interrupted(_signum, _frame):
        raise KeyboardInterrupt

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, interrupted)


def options(prefix: str, subnet: str) -> str:
    """The options of scripts/emulate-cluster.sh that name this cluster."""
    return f"--prefix {prefix} --subnet {subnet}"


@contextlib.contextmanager
def emulated_cluster(prefix: str, subnet: str, n_hosts: int, rate: str, cpus: str | None = None,
                     mem: str | None = None) -> Iterator[Cluster]:
    """A fresh emulated cluster of n_hosts, up for the block and taken down after it, even on
    Ctrl-C. One that exists already is someone else's: never touched."""
    c = Cluster(prefix, subnet)
    if c.is_up or c._leftovers():
        raise Failure(f"an emulated cluster {prefix} exists already; `scripts/emulate-cluster.sh {options(prefix, subnet)} "
                      f"down` it or choose another --prefix and --subnet")
    log(f"scripts/emulate-cluster.sh {options(prefix, subnet)} up {n_hosts} --rate {rate}"
        + (f" --cpus {cpus}" if cpus else "") + (f" --mem {mem}" if mem else ""))
    try:
        c.up(n_hosts, rate, cpus, mem)
        yield c
    finally:
        # A second Ctrl-C must not leave half a cluster behind.
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        log(f"scripts/emulate-cluster.sh {options(prefix, subnet)} down")
        try:
            c.down()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def on_host(c: Cluster, k: int, argv: list[str]) -> list[str]:
    """The command that runs argv on host k: THE one place that enters a host. Through the
    launcher Hydra uses for the cluster's ranks (`emulate-cluster.sh on K`): the host's cgroups,
    network namespace, hostname and node-local directories; `exec` keeps the process the
    wrapper's own pid, so ending its process group ends it."""
    return [str(c.wrapper), c.host(k), "exec " + shlex.join(argv)]


def main_guard(main) -> int:
    """A campaign's exit status: `Error: interrupted` (130) on Ctrl-C or SIGTERM, one `Error:` line
    (1) for a cluster that cannot be set up."""
    stop_signals_interrupt()
    try:
        return main()
    except KeyboardInterrupt:
        log("Error: interrupted")
        return 130
    except (Failure, CgroupError) as e:
        log(f"Error: {e}")
        return 1
