"""CPU and memory of the emulated cluster's hosts (cluster/hosts.py): one cgroup per host,
with a CFS bandwidth quota (`--cpus`) and a memory limit without swap (`--mem`), in the manner of
Mininet's CPU-limited hosts. Every process the cluster's launcher starts on a host joins its
groups, so each rank, its Hydra proxy and any child are held to the host's share.

cgroup v1 and v2 are both handled, as /proc/self/mountinfo shows them: v1 with cpu, cpuacct and
memory each in a hierarchy of its own or together (the usual `/sys/fs/cgroup/cpu,cpuacct`), v2 as one
hierarchy. The groups are made under this process's own cgroup (PATH/PREFIX/hK), so a job's limits
stack under whatever holds the caller. On v2 a group that holds processes cannot give controllers to
children (systemd's scopes, a container's root): its processes are moved into a leaf group of
their own (LEAF) first, then cpu and memory are enabled in its cgroup.subtree_control (and in each
group above it that does not delegate them yet); `down` undoes it all when no other group is left there.

Why the shortest CFS period (the quota is the kernel's minimum of 1 ms: a 2 ms period at 0.5 CPU,
4 ms at 0.25, 10 ms at most): a node with a quarter of a core is a node whose CPU runs at a
quarter of the speed, all the time. A long period lets a host that was idle run at full speed for
the whole quota at the start of the next period, so a bursty load (an `iterative` stage: a short
compute, then a long wait) gets more than its share, and a continuous one (a stage kept busy by
pipelined speculation, a draft) does not. Measured on 4 hosts × 0.5 CPU (BENCHMARKS.md, "Scaling
on nodes with their own CPU"): with a 10 ms period `iterative` decoded 36 % faster than with 2 ms,
while `pipeinfer` ran the same; the 1-ms-quota period makes a host a uniformly slower node. The
kernel's 100 ms default would also stall a 20 ms layer evaluation for 75 ms at a quarter core.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path(os.environ.get("PIPEINFER_EMU_CGROUP_ROOT", "/sys/fs/cgroup"))
MIN_QUOTA_US = 1_000  # the kernel's smallest CFS quota
MAX_PERIOD_US = 10_000
PERIOD_ENV = "PIPEINFER_EMU_CFS_PERIOD_US"  # a fixed period instead (to compare emulations)
V1_CONTROLLERS = ("cpu", "cpuacct", "memory")
V2_CONTROLLERS = ("cpu", "memory")
LEAF = "pipeinfer-emu-procs"  # where a v2 group's own processes go so that it can have children with controllers


def cfs_period_us(cpus: float) -> int:
    """The CFS period for a host of `cpus`: below one CPU the shortest whose quota is the kernel's
    1 ms minimum (2 ms at 0.5 CPU, 4 ms at 0.25), else 10 ms. See the module's docstring for why."""
    if os.environ.get(PERIOD_ENV):
        return int(os.environ[PERIOD_ENV])
    if cpus >= 1:
        # A whole core or more: a rank's one compute thread never meets the quota, and a period of
        # 1 ms would throttle it for every blip of its other threads (polling, MPI), at a cost.
        return MAX_PERIOD_US
    return int(min(MAX_PERIOD_US, max(MIN_QUOTA_US, round(MIN_QUOTA_US / cpus))))


class CgroupError(Exception):
    """A cgroup could not be made or read; the message names the file and the fix."""


def _per_host(values: list, n_hosts: int, what: str) -> list:
    """One value for every host, or one per host."""
    if len(values) == 1:
        return values * n_hosts
    if len(values) != n_hosts:
        raise CgroupError(f"{what} gives {len(values)} values for {n_hosts} hosts: give one, or one per host")
    return values


def parse_cpus(text: str, n_hosts: int) -> list[float | None]:
    """`--cpus 0.5` (every host) or `--cpus 1,0.5,0.5` (one per host); `none` = unlimited."""
    values: list[float | None] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part in ("none", "max", ""):
            values.append(None)
            continue
        try:
            v = float(part)
        except ValueError:
            raise CgroupError(f"--cpus {text!r}: expected CPUs per host such as 0.5, or one value per host such as 1,0.5,0.5") from None
        if not v * MAX_PERIOD_US >= MIN_QUOTA_US:
            raise CgroupError(f"--cpus {part}: at least {MIN_QUOTA_US / MAX_PERIOD_US:g} CPU per host "
                              f"(the kernel's smallest quota is 1 ms of a period of at most {MAX_PERIOD_US // 1000} ms)")
        if v > (have := os.cpu_count() or 1):
            raise CgroupError(f"--cpus {part}: this machine has {have} CPU{'s' if have > 1 else ''}; give each host "
                              f"at most {have} (hosts may share them: 4 hosts x 0.5 CPU on 2 CPUs)")
        values.append(v)
    return _per_host(values, n_hosts, f"--cpus {text!r}")


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_mem(text: str, n_hosts: int) -> list[int | None]:
    """`--mem 1g` (every host) or `--mem 2g,512m` (one per host); `none` = unlimited."""
    values: list[int | None] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part in ("none", "max", ""):
            values.append(None)
            continue
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", part)
        if not m or m.group(2) not in _UNITS:
            raise CgroupError(f"--mem {text!r}: expected a size such as 512m, 1.5g or 2gib per host")
        size = int(float(m.group(1)) * _UNITS[m.group(2)])
        if size < 16 << 20:
            raise CgroupError(f"--mem {part}: at least 16m per host")
        values.append(size)
    return _per_host(values, n_hosts, f"--mem {text!r}")


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def _own_paths(proc_cgroup: str) -> dict[str, str]:
    """Controller -> this process's cgroup path, from /proc/self/cgroup ('' = the v2 hierarchy)."""
    out: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for name in parts[1].split(",") if parts[1] else [""]:
                out[name] = parts[2]
    return out


@dataclass(frozen=True)
class Hierarchy:
    """A mounted cgroup hierarchy: its mount point, the path of the hierarchy at that point (a
    container's mount shows only its own subtree) and its controllers (v1; empty for v2)."""

    point: Path
    mount_root: str
    controllers: tuple[str, ...]

    @property
    def key(self) -> str:
        """The name a cluster's state keeps it under: 'cpu,cpuacct', 'memory'; '' for v2."""
        return ",".join(self.controllers)

    def group(self, own: str) -> Path:
        """The directory of the cgroup `own` (a path of /proc/self/cgroup) in this mount."""
        root = self.mount_root.rstrip("/")
        if root and not (own == root or own.startswith(root + "/")):
            raise CgroupError(f"this process's cgroup {own} is outside the hierarchy mounted at {self.point} "
                              f"(which shows {self.mount_root}); run where the cgroup hierarchy is mounted whole")
        return self.point.joinpath(*[x for x in own[len(root):].split("/") if x])


_MOUNT_OPTIONS = {"rw", "ro", "none", "xattr", "noprefix", "clone_children", "cpuset_v2_mode", "favordynmods"}


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def hierarchies(root: Path, mountinfo: str | None = None) -> tuple[list[Hierarchy], Hierarchy | None]:
    """(the v1 hierarchies, the v2 one) mounted at or under root, from /proc/self/mountinfo; where
    it names none there (a tree made for a test), from the directories: a v1 hierarchy per directory
    with a `tasks` file, named by its controllers (`cpu,cpuacct`), v2 where cgroup.controllers is."""
    if mountinfo is None:
        mountinfo = Path("/proc/self/mountinfo").read_text() if Path("/proc/self/mountinfo").exists() else ""
    v1: list[Hierarchy] = []
    v2: Hierarchy | None = None
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) < 5 or len(r) < 3:
            continue
        point = Path(_unescape(f[4]))
        if point != root and root not in point.parents:
            continue
        if r[0] == "cgroup":
            names = tuple(o for o in r[2].split(",") if o not in _MOUNT_OPTIONS and "=" not in o)
            if names and all(h.controllers != names for h in v1):
                v1.append(Hierarchy(point, f[3], names))
        elif r[0] == "cgroup2" and v2 is None:
            v2 = Hierarchy(point, f[3], ())
    if v1 or v2:
        return v1, v2
    if not root.is_dir():
        return [], None
    for d in sorted(root.iterdir()):
        if d.is_dir() and not d.is_symlink() and (d / "tasks").exists():
            v1.append(Hierarchy(d, "/", tuple(d.name.split(","))))
    if (root / "cgroup.controllers").exists():
        v2 = Hierarchy(root, "/", ())
    elif (root / "unified" / "cgroup.controllers").exists():
        v2 = Hierarchy(root / "unified", "/", ())
    return v1, v2


@dataclass
class HostUsage:
    """What `status` shows of a host's groups."""

    cpu_s: float  # CPU time used by every process of the host
    throttled_s: float  # time its processes were held back by the quota
    n_throttled: int  # periods in which they were
    mem_peak: int  # the largest memory use seen (bytes)
    oom_kills: int  # processes the OOM killer ended because the host's limit was reached


class Cgroups:
    """The groups of one emulated cluster: v1 or v2, found from the mounted hierarchies.

    `bases` maps a hierarchy's key (its v1 controllers, `cpu,cpuacct`; '' for v2) to the cluster's
    group in it; `changes` records what `create` changed above that group (v2: the leaf its
    parent's processes were moved to, the controllers it enabled) so that `remove` can undo it."""

    def __init__(self, prefix: str, root: Path = CGROUP_ROOT, proc_cgroup: str | None = None,
                 mountinfo: str | None = None):
        self.prefix, self.root = prefix, root
        self.changes: dict = {}
        self.v2_top: Path | None = None
        if proc_cgroup is None:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        own = _own_paths(proc_cgroup)
        v1, v2 = hierarchies(root, mountinfo)
        picked = {name: next((h for h in v1 if name in h.controllers), None) for name in V1_CONTROLLERS}
        if all(picked.values()) and all(n in own for n in V1_CONTROLLERS):
            self.version = 1
            self.bases = {h.key: h.group(own[h.controllers[0]]) / prefix
                          for h in dict.fromkeys(picked.values())}
        elif v2 is not None and "" in own:
            self.version = 2
            self.bases = {"": v2.group(own[""]) / prefix}
            self.v2_top = v2.point
        else:
            raise CgroupError(f"no writable cgroup hierarchy with the cpu and memory controllers under {root} "
                              f"(cgroup v1 needs cpu, cpuacct and memory mounted; v2 needs cpu and memory enabled); "
                              f"run as root on a machine that has them, or leave out --cpus/--mem")

    @classmethod
    def from_bases(cls, prefix: str, bases: dict[str, str], changes: dict | None = None) -> "Cgroups":
        """The groups a cluster made, from the bases its state recorded ('' = the v2 hierarchy)."""
        cg = cls.__new__(cls)
        cg.prefix, cg.root = prefix, CGROUP_ROOT
        cg.bases = {k: Path(v) for k, v in bases.items()}
        cg.version = 2 if "" in cg.bases else 1
        cg.changes = dict(changes or {})
        cg.v2_top = None
        return cg

    # paths
    def dir_of(self, controller: str, k: int) -> Path:
        """Host k's group in the hierarchy that holds `controller` (v1), or its only group (v2)."""
        if self.version == 2:
            return self.bases[""] / f"h{k}"
        return next(b for key, b in self.bases.items() if controller in key.split(",")) / f"h{k}"

    def host_dirs(self, k: int) -> dict[str, Path]:
        return {n: b / f"h{k}" for n, b in self.bases.items()}

    def procs_files(self, k: int) -> list[Path]:
        """The files a process writes its pid to, to join host k's groups."""
        return [d / "cgroup.procs" for d in self.host_dirs(k).values()]

    def namespace_mounts(self) -> str:
        """Shell lines, run inside a host's new mount and cgroup namespaces, that show the host its
        own groups as a container sees them: `ip netns exec` mounts a fresh /sys, without the
        cgroup hierarchies, and a cgroup namespace entered after joining the host's groups makes
        them the root, so /sys/fs/cgroup/cpu/cpu.cfs_quota_us is the host's quota. A hierarchy of
        several controllers is mounted once, with all of them (a second mount naming only one
        fails), under its own name, with a link for each controller (`cpu -> cpu,cpuacct`), as
        systemd lays it out. (Quoted for the single-quoted script of the launcher.)"""
        if self.version == 2:
            return "mount -t cgroup2 cgroup2 /sys/fs/cgroup || exit 255\n"
        lines = ["mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup || exit 255"]
        for key in self.bases:
            lines.append(f"mkdir -p /sys/fs/cgroup/{key} && mount -t cgroup -o {key} cgroup /sys/fs/cgroup/{key} || exit 255")
            for name in key.split(","):
                if name != key:
                    lines.append(f"ln -s {key} /sys/fs/cgroup/{name} || exit 255")
        return "\n".join(lines) + "\n"

    # making and removing
    def create(self, n_hosts: int, cpus: list[float | None], mem: list[int | None]) -> None:
        try:
            self._create(n_hosts, cpus, mem)
        except OSError as e:
            raise CgroupError(f"cannot set up the hosts' cgroups ({e.filename or ''}: {e.strerror}); "
                              f"run as root with a writable /sys/fs/cgroup, or leave out --cpus/--mem") from None

    def _create(self, n_hosts: int, cpus: list[float | None], mem: list[int | None]) -> None:
        if self.version == 2:
            self.changes = enable_v2(self.bases[""].parent, V2_CONTROLLERS, self.v2_top)
            self.bases[""].mkdir(exist_ok=True)
            _write(self.bases[""] / "cgroup.subtree_control", " ".join(f"+{c}" for c in V2_CONTROLLERS))
        else:
            for b in self.bases.values():
                b.mkdir(exist_ok=True)
        for k in range(n_hosts):
            dirs = self.host_dirs(k)
            for d in dirs.values():
                d.mkdir(exist_ok=True)
            self._limit(k, cpus[k], mem[k])

    def _limit(self, k: int, cpus: float | None, mem: int | None) -> None:
        period = MAX_PERIOD_US if cpus is None else cfs_period_us(cpus)
        quota = -1 if cpus is None else max(MIN_QUOTA_US, round(cpus * period))
        if self.version == 1:
            cpu, memory = self.dir_of("cpu", k), self.dir_of("memory", k)
            _write(cpu / "cpu.cfs_period_us", str(period))
            _write(cpu / "cpu.cfs_quota_us", str(quota))
            if mem is not None:
                _write(memory / "memory.limit_in_bytes", str(mem))
                _write(memory / "memory.swappiness", "0")
                if (memory / "memory.memsw.limit_in_bytes").exists():
                    _write(memory / "memory.memsw.limit_in_bytes", str(mem))  # no swap beyond the limit
        else:
            d = self.dir_of("", k)
            _write(d / "cpu.max", f"{'max' if quota < 0 else quota} {period}")
            if mem is not None:
                _write(d / "memory.max", str(mem))
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", "0")

    def pids(self) -> list[int]:
        out: list[int] = []
        for b in self.bases.values():
            for f in b.glob("h*/cgroup.procs"):
                with contextlib.suppress(OSError):
                    out += [int(x) for x in f.read_text().split()]
        return sorted(set(out))

    def remove(self) -> list[str]:
        """Remove every group this cluster made (they must be empty), then undo `changes` where no
        other group is left beside the leaf; returns the groups that stayed."""
        left = []
        for b in self.bases.values():
            for d in sorted(b.glob("h*"), reverse=True) + [b]:
                if not d.is_dir():
                    continue
                for _ in range(50):
                    try:
                        d.rmdir()
                        break
                    except OSError:
                        time.sleep(0.1)  # a killed process leaves its group a moment later
                else:
                    left.append(str(d))
        if not left and self.changes:
            undo_v2(self.changes)
            self.changes = {}
        return left

    def exists(self) -> bool:
        return any(b.is_dir() for b in self.bases.values())

    # reading
    def usage(self, k: int) -> HostUsage:
        if self.version == 1:
            cpu, acct, memory = self.dir_of("cpu", k), self.dir_of("cpuacct", k), self.dir_of("memory", k)
            stat = _kv(cpu / "cpu.stat")
            return HostUsage(cpu_s=_int(acct / "cpuacct.usage") / 1e9,
                             throttled_s=stat.get("throttled_time", 0) / 1e9, n_throttled=stat.get("nr_throttled", 0),
                             mem_peak=_int(memory / "memory.max_usage_in_bytes"),
                             oom_kills=_kv(memory / "memory.oom_control").get("oom_kill", 0))
        d = self.dir_of("", k)
        stat = _kv(d / "cpu.stat")
        return HostUsage(cpu_s=stat.get("usage_usec", 0) / 1e6, throttled_s=stat.get("throttled_usec", 0) / 1e6,
                         n_throttled=stat.get("nr_throttled", 0), mem_peak=_int(d / "memory.peak"),
                         oom_kills=_kv(d / "memory.events").get("oom_kill", 0))

    def limits(self, k: int) -> tuple[float | None, int | None]:
        if self.version == 1:
            cpu, memory = self.dir_of("cpu", k), self.dir_of("memory", k)
            quota, period = _int(cpu / "cpu.cfs_quota_us"), _int(cpu / "cpu.cfs_period_us")
            mem = _int(memory / "memory.limit_in_bytes")
            return (quota / period if quota > 0 and period else None), (mem if mem < 1 << 62 else None)
        d = self.dir_of("", k)
        cpu = (d / "cpu.max").read_text().split()
        mem = (d / "memory.max").read_text().strip()
        return (int(cpu[0]) / int(cpu[1]) if cpu[0] != "max" else None), (int(mem) if mem.isdigit() else None)


# -- cgroup v2: controllers for a group's children ------------------------------------------------

def _words(path: Path) -> list[str]:
    with contextlib.suppress(OSError):
        return path.read_text().split()
    return []


def _move_procs(src: Path, dst: Path) -> None:
    """Every process of src into dst, until src holds none (one that forks meanwhile is caught on
    the next pass; one that exits is skipped)."""
    for _ in range(20):
        pids = _words(src / "cgroup.procs")
        if not pids:
            return
        for pid in pids:
            try:
                _write(dst / "cgroup.procs", pid)
            except OSError as e:
                if e.errno not in (errno.ESRCH, errno.ENOENT):
                    raise
    raise CgroupError(f"the processes of {src} keep coming back; cannot move them to {dst}")


def _enable(group: Path, controllers: list[str], leaf_ok: bool) -> str | None:
    """Write +controllers to group's cgroup.subtree_control. A non-root v2 group that holds
    processes refuses (EBUSY: no internal processes): with leaf_ok its processes first move into
    group/LEAF (returned), else one Error naming the group."""
    text = " ".join(f"+{c}" for c in controllers)
    try:
        _write(group / "cgroup.subtree_control", text)
        return None
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
        if not leaf_ok:
            raise CgroupError(f"cannot enable {text} in {group / 'cgroup.subtree_control'}: processes of others are "
                              f"in {group}; move them to a leaf group, or leave out --cpus/--mem") from None
    leaf = group / LEAF
    leaf.mkdir(exist_ok=True)
    _move_procs(group, leaf)
    _write(group / "cgroup.subtree_control", text)
    return str(leaf)


def enable_v2(group: Path, controllers: tuple[str, ...], top: Path | None = None) -> dict:
    """Make `controllers` available to group's children (cgroup v2): enabled in the
    cgroup.subtree_control of every group from `top` (the hierarchy's mount point) down to group's
    parent that does not delegate them yet, then in group's own, its processes moved into
    group/LEAF first if it holds any. Returns what changed, for undo_v2."""
    top = top or group
    chain = [group] if group == top or top not in group.parents else \
        [top, *reversed([d for d in group.parents if top in d.parents]), group]
    changes: dict = {"group": str(group), "enabled": [], "leaf": None, "ancestors": []}
    for d in chain:
        missing = [c for c in controllers if c not in _words(d / "cgroup.subtree_control")]
        if not missing:
            continue
        offered = _words(d / "cgroup.controllers")
        if absent := [c for c in missing if c not in offered]:
            raise CgroupError(f"the cgroup {d} does not have the {', '.join(absent)} controller"
                              f"{'s' if len(absent) > 1 else ''} (cgroup.controllers: {' '.join(offered) or 'none'}); "
                              f"enable {' '.join('+' + c for c in absent)} in {d.parent / 'cgroup.subtree_control'}, "
                              f"or leave out --cpus/--mem")
        if d == group:
            changes["leaf"] = _enable(d, missing, leaf_ok=True)
            changes["enabled"] = missing
        else:
            _enable(d, missing, leaf_ok=False)
            changes["ancestors"].append([str(d), missing])
    return changes if changes["enabled"] or changes["ancestors"] else {}


def undo_v2(changes: dict) -> None:
    """Undo enable_v2 when the leaf is the group's only child: the controllers it enabled off, the
    leaf's processes back, the leaf removed, then each ancestor's controllers off, innermost first
    (the kernel refuses while any group below still uses one: another cluster keeps them).
    Anything else left in the group (another cluster) keeps it all."""
    group = Path(changes["group"])
    leaf = Path(changes["leaf"]) if changes.get("leaf") else None
    children = [d for d in group.iterdir() if d.is_dir()] if group.is_dir() else []
    if any(d != leaf for d in children):
        return
    with contextlib.suppress(OSError):
        if changes.get("enabled"):
            _write(group / "cgroup.subtree_control", " ".join(f"-{c}" for c in changes["enabled"]))
        if leaf is not None and leaf.is_dir():
            _move_procs(leaf, group)
            leaf.rmdir()
    for d, enabled in reversed(changes.get("ancestors", [])):
        with contextlib.suppress(OSError):
            _write(Path(d) / "cgroup.subtree_control", " ".join(f"-{c}" for c in enabled))
def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _int(path: Path) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _kv(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("-").isdigit():
                out[parts[0]] = int(parts[1])
    return out
