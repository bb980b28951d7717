"""An emulated cluster on one machine: N "hosts", each a network namespace with its own hostname,
joined by veth pairs to a bridge, every link rate-limited with tc tbf (both directions). MPI jobs
run one rank per host through the bundled Hydra mpiexec, over TCP through the shaped links.

Usage (as root; the code is cluster/, run from the checkout or with its Python):
  emulate-cluster.sh up N [--rate RATE] [--cpus C] [--mem SIZE]
                                               make hosts PREFIX-h0 .. PREFIX-h{N-1}
  emulate-cluster.sh run N [--rate RATE] -- GENERATE-ARGS...
                                               up, one `pipeinfer generate` job, down
  emulate-cluster.sh mpiexec [-n N] -- CMD...  run CMD under Hydra's mpiexec, one rank per host
  emulate-cluster.sh on K -- CMD...            run CMD on host K (its namespace, hostname and cgroups),
                                               e.g. a server that a job on the hosts talks to
  emulate-cluster.sh exec -- CMD...            run CMD with the environment that makes
                                               `pipeinfer generate/bench --ranks N` use the hosts
  emulate-cluster.sh env                       print that environment as `export` lines
  emulate-cluster.sh rate RATE                 reshape every link of a cluster that is up
  emulate-cluster.sh status                    hosts, addresses, rates, link byte counters
  emulate-cluster.sh down                      remove everything `up` created

Options (before or after the subcommand's own arguments):
  --prefix P     name of every object created: namespaces/hostnames P-h0.., bridge P-br, host-side
                 veths P-h0.. (default pi-emu; at most 8 characters). Only objects with this prefix
                 are ever touched, so several clusters may coexist with distinct prefixes and subnets.
  --subnet A.B.C.0/24   the bridge is A.B.C.1, host k is A.B.C.(k+2) (default 10.213.0.0/24)
  RATE           a tc rate: 10mbit, 100mbit, 1gbit, 500kbit ... or `none` (no shaping).
  --cpus C       CPU bandwidth of each host, in CPUs: 0.5 = half a core (a CFS quota of 1 ms every
                 2 ms), or one value per host for unequal nodes (1,0.5,0.5); none = unlimited.
  --mem SIZE     memory limit of each host (512m, 2g; one per host allowed), swap off. A host that
                 exceeds it has a process ended by the OOM killer, and the job's end names the host.

CPU and memory (--cpus, --mem): each host gets its own cgroups (v1: cpu, cpuacct, memory; or v2)
under this process's cgroup, PATH/PREFIX/hK; every process started on the host through the
cluster's launcher joins them. `status` shows each host's CPU time, throttled time and peak memory;
`down` removes the groups. Without --cpus every host shares all of this machine's cores, so an
`iterative` job borrows the idle hosts' cores, which no real cluster allows: use --cpus for any
comparison of modes. The CFS period is the shortest whose quota is the kernel's 1 ms (4 ms at a
quarter core), so that a host computes like a uniformly slower node: with a long period an idle
host runs its whole quota at full speed, which favours bursty loads (cluster/cgroups.py).

What is emulated: bandwidth (a token bucket on egress of both ends of each host's veth, so each host
has RATE up and RATE down), separate hostnames, TCP between hosts. What is NOT: latency. The kernel
here has no netem, so links are rate-limited but not delayed (sub-millisecond round trips); results
say nothing about high-latency networks.

MPI: UCX is told to use TCP on the namespace's eth0 (UCX_TLS=tcp, UCX_NET_DEVICES=eth0; and
FI_PROVIDER=tcp for the ofi netmod). Without it, UCX sees that the peers share a kernel and moves
the bytes through shared memory, around the shaped links.

Files: the hosts share this machine's file system, except the directories listed (colon-separated)
in PIPEINFER_EMU_NODE_LOCAL when a job starts: host PREFIX-h0 sees them as they are, and every other
host PREFIX-hK sees its own directory DIR.PREFIX-hK in their place (created empty on first use, kept
between jobs), as a node's local disk. A model file or a cache in such a directory is then on the
head's host only, e.g. PIPEINFER_EMU_NODE_LOCAL=/tmp/models:/tmp/cache with PIPEINFER_CACHE=/tmp/cache.

Host names resolve through lines added to /etc/hosts (each marked "# pipeinfer emulate-cluster
PREFIX"), removed by `down`. `run`, and `up` when it fails half-way, remove everything on exit,
on error and on SIGINT/SIGTERM/SIGHUP. `down` also kills any process still inside the namespaces
(they can only have been started through this cluster).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys

from cluster.cgroups import CgroupError, human
from cluster.hosts import DEFAULT_PREFIX, DEFAULT_RATE, DEFAULT_SUBNET, ROOT, Cluster, Failure, require_root


def run_on_cluster(c: Cluster, cmd: list[str]) -> int:
    """run_child on the cluster; a host that ran out of memory during it is named in one line."""
    before = c.usage()
    rc = run_child(cmd, c.env())
    for line in c.memory_failures(before):
        print(f"Error: {line}", file=sys.stderr)
    return rc


# -- command line -------------------------------------------------------------------------------

def run_child(cmd: list[str], env: dict[str, str]) -> int:
    """Run cmd in the foreground; SIGINT/SIGTERM/SIGHUP are passed on to it, and it is waited for."""
    try:
        proc = subprocess.Popen(cmd, env={**os.environ, **env})
    except OSError as e:
        raise Failure(f"cannot run {cmd[0]}: {e.strerror} (MPIEXEC= and PIPEINFER= name another one)") from None
    got: list[int] = []

    def forward(signum, _frame):
        got.append(signum)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            try:
                rc = proc.wait(timeout=30 if got else None)
                break
            except subprocess.TimeoutExpired:  # did not stop after the signal
                proc.kill()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 128 + got[0] if got and rc < 0 else (rc if rc >= 0 else 128 - rc)


def _split_dashdash(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, rest = _split_dashdash(argv)
    p = argparse.ArgumentParser(prog="emulate-cluster.sh", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["up", "down", "run", "mpiexec", "exec", "on", "env", "rate", "status"])
    p.add_argument("arg", nargs="?", help="N for up/run, RATE for rate")
    p.add_argument("--rate", default=DEFAULT_RATE, help=f"link rate for up/run (default {DEFAULT_RATE})")
    p.add_argument("--prefix", default=os.environ.get("PIPEINFER_EMU_PREFIX", DEFAULT_PREFIX))
    p.add_argument("--subnet", default=os.environ.get("PIPEINFER_EMU_SUBNET", DEFAULT_SUBNET))
    p.add_argument("-n", type=int, help="ranks for mpiexec (default: one per host)")
    p.add_argument("--cpus", help="CPUs per host for up/run: 0.5, or one per host (1,0.5,0.5); default: all, shared")
    p.add_argument("--mem", help="memory limit per host for up/run: 512m, 2g, or one per host; default: none")
    p.add_argument("--json", action="store_true", help="status: also print the figures as one JSON line")
    a = p.parse_args(own)

    def interrupted(signum, _frame):
        raise KeyboardInterrupt

    # SIGTERM and SIGHUP, like Ctrl-C, unwind: a half-made `up` or a `run` removes what it made.
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, interrupted)
    try:
        c = Cluster(a.prefix, a.subnet)
        if a.command in ("up", "run"):
            if not (a.arg or "").isdigit():
                raise Failure(f"`{a.command}` needs the number of hosts: {a.command} N [--rate RATE]")
            n = int(a.arg)
        if a.command == "up":
            c.up(n, a.rate, a.cpus, a.mem)
            shares = sorted({c.share(k) for k in range(n)}, key=[c.share(k) for k in range(n)].index)
            print(f"up: {n} hosts {c.host(0)}..{c.host(n - 1)} ({c.addr(0)}..{c.addr(n - 1)}), "
                  f"links at {a.rate} each way, bridge {c.bridge} {c.bridge_addr}; no added latency; "
                  f"each host {' / '.join(shares)}" + ("" if c.cgroups else " (shared with every other host)"))
            return 0
        if a.command == "down":
            require_root()
            c.down()
            return 0
        if a.command == "rate":
            if not a.arg:
                raise Failure("`rate` needs a RATE, e.g. 10mbit")
            c.env()  # must be up
            c.set_rate(a.arg)
            return 0
        if a.command == "status":
            if not c.is_up:
                print(f"{c.prefix}: not up" + (f" (leftovers: {', '.join(c._leftovers())})" if c._leftovers() else ""))
                return 0
            print(f"{c.prefix}: {c.n_hosts} hosts, links at {c.rate}, bridge {c.bridge} {c.bridge_addr}")
            usage = c.usage()
            for h, cnt in c.counters().items():
                k = int(h.rsplit('h', 1)[1])
                print(f"  {h} {c.addr(k)}  sent {cnt['tx_by_host']} B  received {cnt['rx_by_host']} B")
                if h in usage:
                    u = usage[h]
                    print(f"    {c.share(k)}: CPU {u['cpu_s']:.2f} s, throttled {u['throttled_s']:.2f} s "
                          f"({u['n_throttled']} periods), peak memory {human(u['mem_peak'])}"
                          + (f", {u['oom_kills']} killed by the OOM killer" if u["oom_kills"] else ""))
            if a.json:
                print(json.dumps({"hosts": c.n_hosts, "rate": c.rate, "links": c.counters(), "usage": usage}))
            return 0
        if a.command == "env":
            for k, v in c.env().items():
                print(f"export {k}={shlex.quote(v)}")
            return 0
        if a.command == "exec":
            if not rest:
                raise Failure("`exec` needs a command after --")
            return run_on_cluster(c, rest)
        if a.command == "on":
            if not (a.arg or "").isdigit() or not rest:
                raise Failure("`on` needs a host number and a command: on K -- CMD...")
            c.env()  # must be up
            if int(a.arg) >= c.n_hosts:
                raise Failure(f"host {a.arg} does not exist: the cluster has hosts 0..{c.n_hosts - 1}")
            return run_on_cluster(c, [str(c.wrapper), c.host(int(a.arg)), shlex.join(rest)])
        if a.command == "mpiexec":
            if not rest:
                raise Failure("`mpiexec` needs a command after --")
            return run_on_cluster(c, c.mpiexec_cmd(a.n, rest))
        # run: up, one generate job with one rank per host, down (always)
        if not rest:
            raise Failure("`run` needs the arguments of `pipeinfer generate` after --")
        pipeinfer = os.environ.get("PIPEINFER", str(ROOT / ".venv" / "bin" / "pipeinfer"))
        if c.is_up or c._leftovers():  # someone else's: never taken down by this run
            raise Failure(f"an emulated cluster {c.prefix} exists already; use `exec` on it, "
                          f"or `down` first, or another --prefix and --subnet")
        try:
            c.up(n, a.rate, a.cpus, a.mem)  # removes what it made if it fails
            return run_on_cluster(c, [pipeinfer, "generate", "--ranks", str(n), *rest])
        finally:
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(s, signal.SIG_IGN)
            c.down()
    except KeyboardInterrupt:
        print("Error: interrupted", file=sys.stderr)
        return 130
    except (Failure, CgroupError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
