"""The emulated hosts' cgroups (scripts/emulate_cgroups.py) on fake hierarchies: what `up --cpus
--mem` writes for cgroup v1 and v2, what `status` reads back, and the one-line refusal where no
hierarchy is usable. (tests/test_emulated_cluster.py runs the real thing as root.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import emulate_cgroups as ec  # noqa: E402


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


def _v1(root: Path) -> str:
    for name in ("cpu", "cpuacct", "memory"):
        (root / name / "sandbox").mkdir(parents=True)
        (root / name / "tasks").write_text("")
    return "4:memory:/sandbox\n2:cpuacct:/\n1:cpu:/\n0::/\n"


def test_v1_groups_under_the_callers_own(tmp_path):
    cg = ec.Cgroups("pi-t", tmp_path, _v1(tmp_path))
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
    cg = ec.Cgroups("pi-t", tmp_path, "0::/user\n")
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
        ec.Cgroups("pi-t", tmp_path, "0::/\n")
