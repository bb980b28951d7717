#!/usr/bin/env python3
"""An emulated cluster on one machine: N "hosts", each a network namespace with its own hostname,
joined by veth pairs to a bridge, every link rate-limited with tc tbf (both directions). MPI jobs
run one rank per host through the bundled Hydra mpiexec, over TCP through the shaped links.

Usage (as root; scripts/emulate-cluster.sh is the same with the checkout's Python):
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
host runs its whole quota at full speed, which favours bursty loads (scripts/emulate_cgroups.py).

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
import fcntl
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from emulate_cgroups import CgroupError, Cgroups, human, parse_cpus, parse_mem

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PREFIX = "pi-emu"
DEFAULT_SUBNET = "10.213.0.0/24"
DEFAULT_RATE = "100mbit"
HOSTS_FILE = Path(os.environ.get("PIPEINFER_EMU_HOSTS_FILE", "/etc/hosts"))
STATE_ROOT = Path("/run/pipeinfer-emulate-cluster" if Path("/run").is_dir() else "/tmp/pipeinfer-emulate-cluster")
NS_IFACE = "eth0"  # the veth end inside each namespace

# Hydra's launcher-exec: called as `WRAPPER [ssh options] HOST COMMAND...`, like ssh. It runs
# COMMAND in the namespace HOST, in a UTS namespace of its own whose hostname is HOST, and a mount
# namespace where each directory of PIPEINFER_EMU_NODE_LOCAL is the host's own (but on h0).
SSH_WRAPPER = r"""#!/bin/sh
# Generated by scripts/emulate_cluster.py for the emulated cluster {prefix}: Hydra's launcher-exec.
# Called like ssh ([options] HOST COMMAND...); runs COMMAND in the network namespace HOST with the
# hostname HOST.
while [ $# -gt 0 ]; do
    case $1 in
        -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;
        -*) shift ;;
        *) break ;;
    esac
done
host=$1
shift
case $host in
    {prefix}-h[0-9]*) ;;
    *) echo "emulate-cluster: $host is not a host of the emulated cluster {prefix}" >&2; exit 255 ;;
esac
# The host's CPU and memory (--cpus, --mem): this shell joins its cgroups, and everything it execs
# and starts stays in them.
for file in {cgroup_procs}; do
    echo $$ > "$(echo "$file" | sed "s/@K@/${{host##*-h}}/")" || exit 255
done
exec ip netns exec "$host" unshare --uts --mount{unshare_cgroup} sh -c '
hostname "$0" || exit 255
{cgroup_mounts}case $0 in
    *-h0) ;;
    *) IFS=:
       for dir in $PIPEINFER_EMU_NODE_LOCAL; do
           [ -n "$dir" ] || continue
           mkdir -p "$dir" "$dir.$0" && mount --bind "$dir.$0" "$dir" || exit 255
       done
       unset IFS ;;
esac
exec sh -c "$1"' "$host" "$*"
"""


class Failure(Exception):
    """Reported as one `Error:` line, exit status 1."""


# -- small helpers ------------------------------------------------------------------------------

def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise Failure(f"`{shlex.join(cmd)}` failed: {(r.stderr or r.stdout).strip()}")
    return r


def parse_rate(rate: str) -> int | None:
    """Bits per second of a tc rate (`100mbit`), or None for `none`."""
    if rate.lower() in ("none", "off", "unlimited"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)?", rate.lower())
    if not m:
        raise Failure(f"bad rate {rate!r}: use e.g. 10mbit, 100mbit, 1gbit, 500kbit, or none")
    scale = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9,
             "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}[m.group(2) or "bit"]
    bits = int(float(m.group(1)) * scale)
    if bits < 8000:
        raise Failure(f"rate {rate!r} is too low (at least 8kbit)")
    return bits


def tbf_args(bits: int) -> list[str]:
    """A token bucket at `bits`/s: a burst of 4 ms of traffic (at least 64 KiB, so that a 64 KiB
    GSO packet passes) and a queue of 100 ms (at least two bursts)."""
    rate_bytes = bits / 8
    burst = max(64 * 1024, int(rate_bytes * 0.004))
    limit = max(2 * burst, int(rate_bytes * 0.1))
    return ["tbf", "rate", f"{bits}bit", "burst", str(burst), "limit", str(limit)]


def check_prefix(prefix: str) -> None:
    # Interface names are at most 15 characters: PREFIX-br, PREFIX-h99 and PREFIX-h99p must fit.
    if not re.fullmatch(r"[a-z][a-z0-9-]{0,7}", prefix):
        raise Failure(f"bad prefix {prefix!r}: 1 to 8 characters, lower-case letters, digits and '-'")


def require_root() -> None:
    if os.geteuid() != 0:
        raise Failure("the emulated cluster needs root (network namespaces, veths, tc, /etc/hosts)")
    for tool in ("ip", "tc", "unshare"):
        if not shutil.which(tool):
            raise Failure(f"`{tool}` not found (iproute2 / util-linux)")


# -- the cluster --------------------------------------------------------------------------------

class Cluster:
    """One emulated cluster, named by its prefix. Its state (hosts, addresses, rate) is kept in
    STATE_ROOT/PREFIX/state.json with the Hydra hostfile and the launcher wrapper."""

    def __init__(self, prefix: str = DEFAULT_PREFIX, subnet: str = DEFAULT_SUBNET):
        check_prefix(prefix)
        self.prefix = prefix
        self.net = ipaddress.ip_network(subnet, strict=True)
        if self.net.version != 4 or self.net.prefixlen > 24:
            raise Failure(f"bad subnet {subnet}: an IPv4 network of /24 or larger")
        self.dir = STATE_ROOT / prefix
        self.marker = f"# pipeinfer emulate-cluster {prefix}"
        self.bridge = f"{prefix}-br"
        self.n_hosts = 0
        self.rate: str | None = None
        self.cpus: list[float | None] = []  # per host; None = unlimited
        self.mem: list[int | None] = []
        self.cgroup_bases: dict[str, str] = {}  # controller -> the cluster's group ('' for v2); empty = none
        if (self.dir / "state.json").exists():
            st = json.loads((self.dir / "state.json").read_text())
            self.net = ipaddress.ip_network(st["subnet"])
            self.n_hosts, self.rate = st["n_hosts"], st["rate"]
            self.cpus, self.mem = st.get("cpus", []), st.get("mem", [])
            self.cgroup_bases = st.get("cgroup_bases", {})

    # names and addresses
    def host(self, k: int) -> str:
        return f"{self.prefix}-h{k}"

    def hosts(self) -> list[str]:
        return [self.host(k) for k in range(self.n_hosts)]

    def addr(self, k: int) -> str:
        return str(self.net.network_address + k + 2)

    def _mac(self, k: int) -> str:
        """A locally administered MAC address, from the subnet and k."""
        a, b, c, _ = self.net.network_address.packed
        return f"02:70:{a:02x}:{b:02x}:{c:02x}:{k:02x}"

    @property
    def bridge_addr(self) -> str:
        return str(self.net.network_address + 1)

    @property
    def hostfile(self) -> Path:
        return self.dir / "hostfile"

    @property
    def wrapper(self) -> Path:
        return self.dir / "ssh"

    @property
    def is_up(self) -> bool:
        return (self.dir / "state.json").exists()

    def _save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        state = {"prefix": self.prefix, "subnet": str(self.net), "n_hosts": self.n_hosts, "rate": self.rate,
                 "bridge": self.bridge, "hosts": {self.host(k): self.addr(k) for k in range(self.n_hosts)},
                 "cpus": self.cpus, "mem": self.mem, "cgroup_bases": self.cgroup_bases}
        (self.dir / "state.json").write_text(json.dumps(state, indent=1) + "\n")

    # up / down
    @property
    def cgroups(self) -> Cgroups | None:
        """The hosts' cgroups, when --cpus or --mem made them."""
        return Cgroups.from_bases(self.prefix, self.cgroup_bases) if self.cgroup_bases else None

    def up(self, n: int, rate: str = DEFAULT_RATE, cpus: str | None = None, mem: str | None = None) -> None:
        require_root()
        if not 1 <= n <= 100:
            raise Failure("the number of hosts must be between 1 and 100")
        bits = parse_rate(rate)
        self.cpus = parse_cpus(cpus, n) if cpus else [None] * n
        self.mem = parse_mem(mem, n) if mem else [None] * n
        limited = any(c is not None for c in self.cpus) or any(m is not None for m in self.mem)
        cg = Cgroups(self.prefix) if limited else None  # says in one line when there is no cgroup hierarchy
        if self.is_up or self._leftovers():
            raise Failure(f"an emulated cluster {self.prefix} exists already; run `down` first "
                          f"(or choose another --prefix and --subnet)")
        for other in STATE_ROOT.glob("*/state.json"):
            st = json.loads(other.read_text())
            if ipaddress.ip_network(st["subnet"]).overlaps(self.net):
                raise Failure(f"the subnet {self.net} overlaps the emulated cluster {st['prefix']}")
        for line in sh("ip", "-4", "-o", "route", "show", check=False).stdout.splitlines():
            dst = line.split()[0]
            if dst != "default" and f" dev {self.bridge} " not in line + " " and \
                    ipaddress.ip_network(dst, strict=False).overlaps(self.net):
                raise Failure(f"the subnet {self.net} overlaps a route of this machine ({line.strip()}); "
                              f"choose another --subnet")
        self.n_hosts, self.rate = n, rate
        if cg is not None:
            if cg.exists():
                raise Failure(f"cgroups of an emulated cluster {self.prefix} exist already ({', '.join(map(str, cg.bases.values()))}); "
                              f"run `down` first")
            self.cgroup_bases = {k: str(v) for k, v in cg.bases.items()}
        try:
            self._save()  # first: a failure half-way leaves a state that `down` understands
            if cg is not None:
                cg.create(n, self.cpus, self.mem)
            # A fixed address: by default a bridge takes the lowest of its ports' addresses, which
            # changes as hosts join and leaves the hosts that joined before with a stale ARP entry.
            sh("ip", "link", "add", self.bridge, "address", self._mac(0xFF), "type", "bridge")
            sh("ip", "addr", "add", f"{self.bridge_addr}/{self.net.prefixlen}", "dev", self.bridge)
            sh("ip", "link", "set", self.bridge, "up")
            for k in range(n):
                ns, veth = self.host(k), self.host(k)
                sh("ip", "netns", "add", ns)
                sh("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
                sh("ip", "link", "set", f"{veth}p", "netns", ns)
                sh("ip", "-n", ns, "link", "set", f"{veth}p", "name", NS_IFACE)
                sh("ip", "-n", ns, "addr", "add", f"{self.addr(k)}/{self.net.prefixlen}", "dev", NS_IFACE)
                sh("ip", "-n", ns, "link", "set", NS_IFACE, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                sh("ip", "link", "set", veth, "master", self.bridge)
                sh("ip", "link", "set", veth, "up")
            self.set_rate(rate, bits)
            self._add_hosts_entries()
            self.hostfile.write_text("".join(f"{h}:1\n" for h in self.hosts()))
            procs = " ".join(shlex.quote(str(f).replace("/h0/", "/h@K@/")) for f in cg.procs_files(0)) if cg else ""
            self.wrapper.write_text(SSH_WRAPPER.format(
                prefix=self.prefix, cgroup_procs=procs, unshare_cgroup=" --cgroup" if cg else "",
                cgroup_mounts=cg.namespace_mounts() if cg else ""))
            self.wrapper.chmod(0o755)
            self._wait_reachable()
        except BaseException:
            self.down()
            raise

    def set_rate(self, rate: str, bits: int | None = None) -> None:
        bits = parse_rate(rate) if bits is None else bits
        for k in range(self.n_hosts):
            for netns, dev in ((None, self.host(k)), (self.host(k), NS_IFACE)):
                tc = ["tc"] + (["-n", netns] if netns else [])
                sh(*tc, "qdisc", "del", "dev", dev, "root", check=False)
                if bits is not None:
                    sh(*tc, "qdisc", "add", "dev", dev, "root", *tbf_args(bits))
        self.rate = rate
        self._save()

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        """Every host opens a TCP connection to a listener on the bridge's address (there is no
        ping here); the bridge forwards between hosts as soon as its ports are up."""
        import socket
        with socket.socket() as srv:
            srv.bind((self.bridge_addr, 0))
            srv.listen(16)
            port = srv.getsockname()[1]
            probe = ("import socket, sys, time\n"
                     "deadline = time.monotonic() + float(sys.argv[3])\n"
                     "while True:\n"
                     "    try:\n"
                     "        socket.create_connection((sys.argv[1], int(sys.argv[2])), 1).close(); break\n"
                     "    except OSError:\n"
                     "        if time.monotonic() > deadline: sys.exit(1)\n"
                     "        time.sleep(0.1)\n")
            for k in range(self.n_hosts):
                r = sh("ip", "netns", "exec", self.host(k), sys.executable, "-c", probe, self.bridge_addr,
                       str(port), str(timeout), check=False)
                if r.returncode != 0:
                    raise Failure(f"{self.host(k)} cannot reach {self.bridge_addr} through the bridge {self.bridge}")
                srv.settimeout(timeout)
                srv.accept()[0].close()  # keep the backlog empty

    def _add_hosts_entries(self) -> None:
        lines = [f"{self.addr(k)} {self.host(k)} {self.marker}\n" for k in range(self.n_hosts)]
        self._rewrite_hosts(lambda old: old + lines)

    def _rewrite_hosts(self, edit) -> None:
        # In place (open r+, truncate): /etc/hosts is often a bind mount that cannot be replaced.
        with open(HOSTS_FILE, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # another cluster may be coming up or down meanwhile
            old = f.readlines()
            if old and not old[-1].endswith("\n"):
                old[-1] += "\n"
            new = edit(old)
            if new != old:
                f.seek(0)
                f.writelines(new)
                f.truncate()

    def _namespaces(self) -> list[str]:
        out = sh("ip", "netns", "list", check=False).stdout
        names = [line.split()[0] for line in out.splitlines() if line.strip()]
        return [n for n in names if re.fullmatch(re.escape(self.prefix) + r"-h\d+", n)]

    def _links(self) -> list[str]:
        out = sh("ip", "-o", "link", "show", check=False).stdout
        names = [m.group(1) for m in re.finditer(r"^\d+: ([^:@]+)[@:]", out, re.M)]
        return [n for n in names if re.fullmatch(re.escape(self.prefix) + r"-(br|h\d+p?)", n)]

    def _hosts_entries(self) -> list[str]:
        with contextlib.suppress(OSError):
            return [line for line in HOSTS_FILE.read_text().splitlines() if line.endswith(self.marker)]
        return []

    def _leftovers(self) -> list[str]:
        return self._namespaces() + self._links() + self._hosts_entries()

    def pids(self) -> list[int]:
        """Processes inside the cluster's namespaces."""
        pids: list[int] = []
        for ns in self._namespaces():
            out = sh("ip", "netns", "pids", ns, check=False).stdout
            pids += [int(p) for p in out.split()]
        return pids

    def down(self) -> None:
        """Remove whatever this cluster's prefix names: processes in its namespaces, namespaces,
        links, /etc/hosts lines, state. Safe to call twice, or after a half-done `up`."""
        cg = self.cgroups
        for _ in range(50):
            pids = self.pids() + (cg.pids() if cg else [])
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        for link in self._links():  # a veth pair goes with either end; the namespace's end may linger
            if not link.endswith("p"):
                sh("ip", "link", "del", link, check=False)
        for ns in self._namespaces():
            sh("ip", "netns", "del", ns, check=False)
        if self._hosts_entries():
            self._rewrite_hosts(lambda old: [line for line in old if not line.rstrip("\n").endswith(self.marker)])
        left_groups = cg.remove() if cg else []
        if left_groups:
            raise Failure(f"could not remove the cgroups {', '.join(left_groups)} (a process is still inside); "
                          f"end it and run `down` again")
        shutil.rmtree(self.dir, ignore_errors=True)
        self.n_hosts, self.cgroup_bases = 0, {}
        deadline = time.monotonic() + 5
        while (left := self._leftovers()) and time.monotonic() < deadline:
            time.sleep(0.1)  # the kernel removes a deleted namespace's devices asynchronously
        if left:
            raise Failure(f"could not remove {', '.join(left)}")

    # running jobs
    def env(self) -> dict[str, str]:
        """What a job needs to run on the hosts. The HYDRA_* variables steer the mpiexec that
        `pipeinfer generate --ranks N` starts; the others reach every rank (Hydra passes the whole
        environment)."""
        if not self.is_up:
            raise Failure(f"the emulated cluster {self.prefix} is not up; run `up N` first")
        return {
            "HYDRA_HOST_FILE": str(self.hostfile),
            "HYDRA_LAUNCHER": "ssh",
            "HYDRA_LAUNCHER_EXEC": str(self.wrapper),
            "HYDRA_IFACE": self.bridge,
            "UCX_TLS": "tcp",  # not shared memory across the namespaces
            "UCX_NET_DEVICES": NS_IFACE,
            "FI_PROVIDER": "tcp",  # the same for the ofi netmod
            "FI_TCP_IFACE": NS_IFACE,
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "passive"),
        }

    def mpiexec_cmd(self, n: int | None, cmd: list[str]) -> list[str]:
        mpiexec = os.environ.get("MPIEXEC", str(ROOT / ".venv" / "bin" / "mpiexec"))
        return [mpiexec, "-f", str(self.hostfile), "-n", str(n or self.n_hosts), "-launcher", "ssh",
                "-launcher-exec", str(self.wrapper), "-iface", self.bridge, *cmd]

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes through each host's link, from the host-side veth: rx = sent by the host."""
        out = {}
        for h in self.hosts():
            stats = Path("/sys/class/net") / h / "statistics"
            out[h] = {"tx_by_host": int((stats / "rx_bytes").read_text()),
                      "rx_by_host": int((stats / "tx_bytes").read_text())}
        return out


    def share(self, k: int) -> str:
        """Host k's CPU and memory limits, as `up` and `status` print them."""
        cpus = self.cpus[k] if k < len(self.cpus) else None
        mem = self.mem[k] if k < len(self.mem) else None
        return f"{'all CPUs' if cpus is None else f'{cpus:g} CPU'}, {'all memory' if mem is None else human(mem)}"

    def usage(self) -> dict:
        """Per host: CPU time, throttled time, peak memory and OOM kills (hosts with cgroups only)."""
        cg = self.cgroups
        if cg is None:
            return {}
        out = {}
        for k in range(self.n_hosts):
            u = cg.usage(k)
            out[self.host(k)] = {"cpus": self.cpus[k], "mem_limit": self.mem[k], "cpu_s": round(u.cpu_s, 3),
                                 "throttled_s": round(u.throttled_s, 3), "n_throttled": u.n_throttled,
                                 "mem_peak": u.mem_peak, "oom_kills": u.oom_kills}
        return out

    def memory_failures(self, before: dict) -> list[str]:
        """One line per host whose memory limit made the OOM killer end a process since `before`."""
        lines = []
        for h, u in self.usage().items():
            killed = u["oom_kills"] - before.get(h, {}).get("oom_kills", 0)
            if killed > 0 and u["mem_limit"] is not None:
                lines.append(f"host {h} reached its memory limit of {human(u['mem_limit'])} (--mem): the out-of-memory "
                             f"killer ended {killed} process{'es' if killed > 1 else ''} there; give the hosts more "
                             f"memory or split the model over more hosts")
        return lines


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
    proc = subprocess.Popen(cmd, env={**os.environ, **env})
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
