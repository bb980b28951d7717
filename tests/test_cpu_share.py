"""The CPU and memory a process may use, read from cgroup v1 and v2 files (runtime/cpu_share.py),
and the thread defaults and waiting policy that follow from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeinfer_cli.runtime import cpu_share as cs


def _v1_tree(root: Path, path: str, quota: int, period: int, parent_quota: int = -1, mem: int | None = None) -> str:
    for d, q in ((root / "cpu", parent_quota), (root / "cpu" / path.strip("/"), quota)):
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.cfs_quota_us").write_text(f"{q}\n")
        (d / "cpu.cfs_period_us").write_text(f"{period}\n")
    mdir = root / "memory" / path.strip("/")
    mdir.mkdir(parents=True, exist_ok=True)
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (mdir / "memory.limit_in_bytes").write_text(f"{mem if mem is not None else 9223372036854771712}\n")
    return f"4:memory:{path}\n2:cpuacct:{path}\n1:cpu:{path}\n0::/\n"


def test_v1_quota_and_memory_limit(tmp_path):
    proc = _v1_tree(tmp_path, "/pi-emu/h1", quota=5000, period=10000, mem=512 << 20)
    assert cs.quota_cpus(tmp_path, proc) == pytest.approx(0.5)
    assert cs.memory_limit_bytes(tmp_path, proc) == 512 << 20


def test_v1_unlimited(tmp_path):
    proc = _v1_tree(tmp_path, "/", quota=-1, period=100000)
    assert cs.quota_cpus(tmp_path, proc) is None
    assert cs.memory_limit_bytes(tmp_path, proc) is None


def test_v1_parent_quota_binds_the_child(tmp_path):
    """A parent group's quota holds its children: the tightest along the path counts."""
    proc = _v1_tree(tmp_path, "/job/rank", quota=20000, period=10000, parent_quota=2500)
    assert cs.quota_cpus(tmp_path, proc) == pytest.approx(0.25)


def test_v2_cpu_max_and_memory_max(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    d = tmp_path / "pi-emu" / "h0"
    d.mkdir(parents=True)
    (tmp_path / "pi-emu" / "cpu.max").write_text("max 100000\n")
    (d / "cpu.max").write_text("25000 100000\n")
    (d / "memory.max").write_text(f"{1 << 30}\n")
    (tmp_path / "pi-emu" / "memory.max").write_text("max\n")
    proc = "0::/pi-emu/h0\n"
    assert cs.quota_cpus(tmp_path, proc) == pytest.approx(0.25)
    assert cs.memory_limit_bytes(tmp_path, proc) == 1 << 30


def test_share_threads_round_the_quota_up():
    assert cs.CpuShare(2, 2, 0.5).threads == 1
    assert cs.CpuShare(2, 2, 0.5).cpus == 0.5
    assert cs.CpuShare(8, 8, 1.5).threads == 2
    assert cs.CpuShare(8, 2, 4.0).threads == 2  # a cpuset of 2 holds it below the quota
    assert cs.CpuShare(2, 2, None).threads == 2 and not cs.CpuShare(2, 2, None).limited
    assert "quota" in cs.CpuShare(2, 2, 0.5).describe()


def _share(monkeypatch, share):
    from pipeinfer_cli.runtime import topology

    monkeypatch.setattr(topology, "cpu_share", lambda: share)
    return topology


def test_default_threads_follow_the_quota(monkeypatch):
    topo = _share(monkeypatch, cs.CpuShare(2, 2, 0.5))
    assert topo.default_threads(1, environ={}) == 1
    assert topo.default_threads(1, environ={topo.WHOLE_HOST_ENV: "1"}) == 1  # an iterative job gets no core beyond its quota
    assert not topo.alone_on_cores(1, 1)  # half a core: spinning would eat the compute's own quota
    topo = _share(monkeypatch, cs.CpuShare(8, 8, 4.0))
    assert topo.default_threads(2, environ={}) == 2  # two ranks share the host's quota of 4
    assert topo.alone_on_cores(4, 2)
    topo = _share(monkeypatch, cs.CpuShare(2, 2, None))
    assert topo.default_threads(2, environ={}) == 1
    assert topo.default_threads(2, environ={topo.WHOLE_HOST_ENV: "1"}) == 2


def test_a_quota_holds_openmp_passive(monkeypatch):
    from pipeinfer_cli.cli import app
    from pipeinfer_cli.runtime import cpu_share

    monkeypatch.setattr(cpu_share, "cpu_share", lambda: cs.CpuShare(2, 2, 0.5))
    assert app.omp_wait_policy({"PIPEINFER_WHOLE_HOST_THREADS": "1"}) == "passive"
    assert app.omp_wait_policy({"OMP_WAIT_POLICY": "active"}) is None  # the user's choice wins
    monkeypatch.setattr(cpu_share, "cpu_share", lambda: cs.CpuShare(2, 2, None))
    assert app.omp_wait_policy({"PIPEINFER_WHOLE_HOST_THREADS": "1"}) == "active"


def test_this_process_share_is_consistent():
    share = cs.cpu_share()
    assert 1 <= share.threads <= share.affinity_cpus <= share.host_cpus
    assert 0 < share.cpus <= share.host_cpus
