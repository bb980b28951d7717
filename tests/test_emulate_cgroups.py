"""The emulated hosts' cgroups (cluster/cgroups.py) on fake hierarchies: what `up --cpus --mem`
writes for cgroup v1 (controllers apart, or cpu and cpuacct together) and v2, what `status` reads
back, and the one-line refusals; then, as root, a real cgroup2 hierarchy whose group holds
processes, and a real v1 `cpu,cpuacct` mount where this kernel allows one. (tests/test_emulated_cluster.py
runs whole clusters as root.)"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

import cluster.cgroups as ec


def test_the_period_is_the_shortest_with_a_1_ms_quota(monkeypatch):
    monkeypatch.delenv(ec.PERIOD_ENV, raising=False)
    assert [ec.cfs_period_us(c) for c in (0.1, 0.25, 0.5, 1, 2)] == [10000, 4000, 2000, 10000, 10000]
    monkeypatch.setenv(ec.PERIOD_ENV, "10000")
    assert ec.cfs_period_us(0.5) == 10000


def test_cpus_and_mem_parse_per_host_or_for_all():
    assert ec.parse_cpus("0.5", 3) == [0.5, 0.5, 0.5]
    assert ec.parse_cpus("1,0.5,none", 3) == [1.0, 0.5, None]
    assert ec.parse_mem("512m", 2) == [512 << 20, 512 << 20]
    assert ec.parse_mem("1.5g,none", 2) == [int(1.5 * (1 << 30)), None]
    for bad, says in (("0.05", "at least 0.1 CPU"), ("1,2", "2 values for 3 hosts"), ("half", "expected CPUs")):
        with pytest.raises(ec.CgroupError, match=says):
            ec.parse_cpus(bad, 3)
    with pytest.raises(ec.CgroupError, match="at least 16m"):
        ec.parse_mem("1m", 1)


def test_more_cpus_per_host_than_the_machine_has_is_refused(monkeypatch):
    monkeypatch.setattr(ec.os, "cpu_count", lambda: 2)
    assert ec.parse_cpus("2", 4) == [2.0] * 4
    with pytest.raises(ec.CgroupError, match=r"--cpus 64: this machine has 2 CPUs; give each host at most 2"):
        ec.parse_cpus("64", 2)
    with pytest.raises(ec.CgroupError, match="--cpus 3: this machine has 2 CPUs"):
        ec.parse_cpus("1,3", 2)


def test_the_command_refuses_more_cpus_than_the_machine_in_one_line():
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([str(root / "scripts" / "emulate-cluster.sh"), "--prefix", "pt-none", "up", "2", "--cpus",
                        str((os.cpu_count() or 1) * 32)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), lines
    assert "this machine has" in lines[0] or "needs root" in lines[0], lines


def _v1(root: Path) -> str:
    for name in ("cpu", "cpuacct", "memory"):
        (root / name / "sandbox").mkdir(parents=True)
        (root / name / "tasks").write_text("")
    return "4:memory:/sandbox\n2:cpuacct:/\n1:cpu:/\n0::/\n"


def test_v1_groups_under_the_callers_own(tmp_path):
    cg = ec.Cgroups("pi-t", tmp_path, _v1(tmp_path), mountinfo="")
    assert cg.version == 1 and cg.bases["memory"] == tmp_path / "memory" / "sandbox" / "pi-t"
    cg.create(2, [0.25, None], [1 << 30, None])
    h0 = cg.host_dirs(0)
    assert (h0["cpu"] / "cpu.cfs_period_us").read_text() == "4000"  # the kernel's smallest quota, 1 ms
    assert (h0["cpu"] / "cpu.cfs_quota_us").read_text() == "1000"
    assert (cg.host_dirs(1)["cpu"] / "cpu.cfs_quota_us").read_text() == "-1"
    assert (h0["memory"] / "memory.limit_in_bytes").read_text() == str(1 << 30)
    assert (h0["memory"] / "memory.swappiness").read_text() == "0"
    assert cg.limits(0) == (0.25, 1 << 30)
    assert cg.procs_files(1)[0] == tmp_path / "cpu" / "pi-t" / "h1" / "cgroup.procs"
    (h0["cpuacct"] / "cpuacct.usage").write_text("1500000000\n")
    (h0["cpu"] / "cpu.stat").write_text("nr_periods 10\nnr_throttled 4\nthrottled_time 300000000\n")
    (h0["memory"] / "memory.max_usage_in_bytes").write_text("7340032\n")
    (h0["memory"] / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    u = cg.usage(0)
    assert (u.cpu_s, u.throttled_s, u.n_throttled, u.mem_peak, u.oom_kills) == (1.5, 0.3, 4, 7340032, 1)
    assert "mount -t cgroup -o memory cgroup /sys/fs/cgroup/memory" in cg.namespace_mounts()


def test_v2_group_with_cpu_max_and_no_swap(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "cgroup.controllers").write_text("cpu memory\n")
    cg = ec.Cgroups("pi-t", tmp_path, "0::/user\n", mountinfo="")
    assert cg.version == 2
    cg.create(1, [1.5], [512 << 20])
    d = cg.host_dirs(0)[""]
    assert (d / "cpu.max").read_text() == "15000 10000"
    assert (d / "memory.max").read_text() == str(512 << 20)
    assert (tmp_path / "user" / "cgroup.subtree_control").read_text() == "+cpu +memory"
    assert cg.limits(0) == (1.5, 512 << 20)
    assert cg.namespace_mounts().startswith("mount -t cgroup2")


def test_no_hierarchy_is_one_line_with_the_fix(tmp_path):
    with pytest.raises(ec.CgroupError, match="no writable cgroup hierarchy .* leave out --cpus/--mem"):
        ec.Cgroups("pi-t", tmp_path, "0::/\n", mountinfo="")


def _v1_together(root: Path) -> tuple[str, str]:
    """The usual v1 layout: cpu and cpuacct in one hierarchy at cpu,cpuacct (links cpu and cpuacct
    to it), memory apart; the caller in /sandbox of each."""
    for name in ("cpu,cpuacct", "memory"):
        (root / name / "sandbox").mkdir(parents=True)
        (root / name / "tasks").write_text("")
    (root / "cpu").symlink_to("cpu,cpuacct")
    (root / "cpuacct").symlink_to("cpu,cpuacct")
    mountinfo = (f"32 31 0:29 / {root}/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
                 f"35 31 0:32 / {root}/memory rw,relatime - cgroup cgroup rw,memory\n")
    return "4:memory:/sandbox\n2:cpu,cpuacct:/sandbox\n0::/\n", mountinfo


def test_v1_with_cpu_and_cpuacct_together(tmp_path):
    own, mountinfo = _v1_together(tmp_path)
    cg = ec.Cgroups("pi-t", tmp_path, own, mountinfo)
    assert cg.version == 1
    assert cg.bases == {"cpu,cpuacct": tmp_path / "cpu,cpuacct" / "sandbox" / "pi-t",
                        "memory": tmp_path / "memory" / "sandbox" / "pi-t"}
    cg.create(2, [0.5, None], [1 << 30, None])
    d = tmp_path / "cpu,cpuacct" / "sandbox" / "pi-t" / "h0"
    assert (d / "cpu.cfs_quota_us").read_text() == "1000" and (d / "cpu.cfs_period_us").read_text() == "2000"
    assert cg.procs_files(0) == [d / "cgroup.procs", tmp_path / "memory" / "sandbox" / "pi-t" / "h0" / "cgroup.procs"]
    (d / "cpuacct.usage").write_text("2500000000\n")  # the same group counts the CPU time
    assert cg.usage(0).cpu_s == 2.5 and cg.limits(0) == (0.5, 1 << 30)
    mounts = cg.namespace_mounts()
    # one mount with both controllers (a mount of `-o cpu` alone fails on such a machine), and the links
    assert "mount -t cgroup -o cpu,cpuacct cgroup /sys/fs/cgroup/cpu,cpuacct" in mounts
    assert "-o cpu cgroup" not in mounts and "-o cpuacct cgroup" not in mounts
    assert "ln -s cpu,cpuacct /sys/fs/cgroup/cpu " in mounts and "ln -s cpu,cpuacct /sys/fs/cgroup/cpuacct " in mounts
    again = ec.Cgroups.from_bases("pi-t", {k: str(v) for k, v in cg.bases.items()})
    assert again.usage(0).cpu_s == 2.5 and again.limits(0) == (0.5, 1 << 30)


def test_a_container_s_mount_shows_its_own_subtree(tmp_path):
    """mountinfo's root field: the hierarchy's /docker/abc is what the mount point shows."""
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    cg = ec.Cgroups("pi-t", tmp_path, "0::/docker/abc/inner\n",
                    f"41 31 0:38 /docker/abc {tmp_path} rw - cgroup2 cgroup2 rw\n")
    assert cg.version == 2 and cg.bases[""] == tmp_path / "inner" / "pi-t"
    with pytest.raises(ec.CgroupError, match="outside the hierarchy"):
        ec.Cgroups("pi-t", tmp_path, "0::/elsewhere\n", f"41 31 0:38 /docker/abc {tmp_path} rw - cgroup2 cgroup2 rw\n")


def test_v2_without_the_controllers_names_the_file_to_write(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "cgroup.controllers").write_text("memory\n")
    (tmp_path / "user" / "cgroup.subtree_control").write_text("")
    cg = ec.Cgroups("pi-t", tmp_path, "0::/user\n", mountinfo="")
    with pytest.raises(ec.CgroupError, match=r"does not have the cpu controller .*enable \+cpu in .*subtree_control"):
        cg.create(1, [0.5], [None])


# -- real hierarchies (root) ------------------------------------------------------------------------

def _mount(fstype: str, options: str | None) -> Path:
    point = Path(tempfile.mkdtemp(prefix="pi-cgtest-"))
    cmd = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, str(point)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        point.rmdir()
        pytest.skip(f"cannot mount {fstype} {options or ''} here: {r.stderr.strip()}")
    return point


def _unmount(point: Path) -> None:
    subprocess.run(["umount", str(point)], check=True)
    point.rmdir()


def _groups_left(point: Path, name: str) -> list[str]:
    return [str(d) for d in point.rglob(name)]


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a cgroup hierarchy needs root")


@needs_root
def test_v2_group_that_holds_processes_gets_a_leaf_and_gives_controllers(tmp_path):
    """A real cgroup2 hierarchy: a group holding a process (as a systemd scope or a container's
    root does), under a parent that does not delegate the controller yet: the parent gets it in its
    cgroup.subtree_control, the group's process moves to a leaf, the group gives it to a child; the
    undo puts everything back as it was. Uses a controller this machine's v2 hierarchy has (cpu
    where v1 does not hold it, else the first offered)."""
    point = _mount("cgroup2", None)
    parent = point / f"pi-cgtest-{os.getpid()}"
    group = parent / "scope"
    sleeper = None
    before = (point / "cgroup.subtree_control").read_text()
    try:
        offered = (point / "cgroup.controllers").read_text().split()
        if not offered:
            pytest.skip("this machine's cgroup2 hierarchy has no controller to enable")
        ctrl = "cpu" if "cpu" in offered else offered[0]
        group.mkdir(parents=True)
        sleeper = subprocess.Popen(["sleep", "600"])
        (group / "cgroup.procs").write_text(str(sleeper.pid))
        changes = ec.enable_v2(group, (ctrl,), top=point)
        assert changes["leaf"] == str(group / ec.LEAF) and changes["enabled"] == [ctrl]
        assert [d for d, _ in changes["ancestors"]] == [str(x) for x in (point, parent)
                                                         if ctrl not in before.split() or x != point]
        assert (group / ec.LEAF / "cgroup.procs").read_text().split() == [str(sleeper.pid)]
        assert ctrl in (group / "cgroup.subtree_control").read_text().split()
        (group / "pi-t").mkdir()  # a child now has the controller
        assert ctrl in (group / "pi-t" / "cgroup.controllers").read_text().split()
        assert ec.enable_v2(group, (ctrl,), top=point) == {}  # a second cluster changes nothing
        (group / "pi-t").rmdir()
        ec.undo_v2(changes)
        assert (group / "cgroup.procs").read_text().split() == [str(sleeper.pid)]
        assert not (group / ec.LEAF).exists() and (group / "cgroup.subtree_control").read_text().strip() == ""
        assert (parent / "cgroup.subtree_control").read_text().strip() == ""
        assert (point / "cgroup.subtree_control").read_text() == before
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
        for d in (group / ec.LEAF, group / "pi-t", group, parent):
            if d.is_dir():
                d.rmdir()
        if (point / "cgroup.subtree_control").read_text() != before:
            (point / "cgroup.subtree_control").write_text(" ".join(f"-{c}" for c in offered if c not in before.split()))
        _unmount(point)
    assert not point.exists()


@needs_root
def test_v1_cpu_and_cpuacct_mounted_together_for_real():
    """Where the kernel lets cpu and cpuacct share a hierarchy (the usual v1 layout: mounting it
    again shares it), the cluster's groups are made and read in it; where they are bound to
    hierarchies of their own (this kernel says EBUSY), skipped: the fake tree above covers it."""
    base = Path(tempfile.mkdtemp(prefix="pi-cgroot-"))
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(base)], check=True)
    try:
        (base / "cpu,cpuacct").mkdir()
        r = subprocess.run(["mount", "-t", "cgroup", "-o", "cpu,cpuacct", "cgroup", str(base / "cpu,cpuacct")],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cpu and cpuacct cannot share a hierarchy here: {r.stderr.strip()}")
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
            hier = next(h for h in ec.hierarchies(base, mountinfo)[0] if "cpu" in h.controllers)
            assert set(hier.controllers) == {"cpu", "cpuacct"}
            group = hier.point / f"pi-cgtest-{os.getpid()}"
            group.mkdir()
            try:
                assert (group / "cpu.cfs_quota_us").exists() and (group / "cpuacct.usage").exists()
            finally:
                group.rmdir()
        finally:
            subprocess.run(["umount", str(base / "cpu,cpuacct")], check=True)
    finally:
        subprocess.run(["umount", str(base)], check=True)
        base.rmdir()
