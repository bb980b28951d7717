"""A profile and a trace predict the job they measured and no other: the model's file (sha256), the
threads each rank computes with (as `generate` would start the job), the ranks per host and the
machine; and the auto split fits weights, KV cache and draft in each rank's share of its host."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from planning import make_profile, rank_costs
from pipeinfer_cli.errors import UsageError
from pipeinfer_cli.models.gguf_info import read_model_info
from pipeinfer_cli.planner.identity import RankShape, default_threads, differences
from pipeinfer_cli.planner.identity import model_sha256
from pipeinfer_cli.planner.split import JobMemory, auto_split
from pipeinfer_cli.runtime.host_facts import host_facts


def run(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeinfer_cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    return lines[0]


def smollm2_profile(path, tmp_path, name: str = "p.json", **rank_fields):
    """Two ranks of SmolLM2 on hosts node0/node1 (2 CPUs, 2 threads each: a job's default there)."""
    info = read_model_info(path)
    ranks = [dataclasses.replace(rank_costs(r), **rank_fields) for r in range(2)]
    prof = make_profile(2, n_layer=info.n_layer, ranks=ranks, file_bytes=info.file_size, sha256=model_sha256(path))
    prof.model.layer_bytes, prof.model.n_embd = info.layer_bytes, info.n_embd
    prof.command = f"pipeinfer calibrate {path} --ranks 2 --threads 1"
    out = tmp_path / name
    prof.save(out)
    return out


# -- the job's identity against the profile's ------------------------------------------------------
def test_each_difference_is_named_with_its_fix():
    prof = make_profile(2, sha256="a" * 64)
    same = [RankShape(r, 2, 1) for r in range(2)]
    assert differences(prof, same, "a" * 64, None, "`pipeinfer calibrate m`") == []
    diffs = differences(prof, [RankShape(0, 1, 2, "other cpu", 2, 2.0), RankShape(1, 1, 2)], "b" * 64, None,
                        "`pipeinfer calibrate m`")
    text = "; ".join(diffs)
    assert "another file of the model" in text
    assert "made for 2 threads per rank, this job uses 1: run `pipeinfer calibrate m` --threads 1" in text
    assert "shared its host with 0 other ranks, in this job it shares it with 1" in text
    assert "CPU test cpu (now other cpu)" in text


def test_an_older_profile_without_identities_is_refused():
    prof = make_profile(1, sha256=None)
    prof.ranks[0].usable_cpus = None
    (diff,) = differences(prof, [RankShape(0, 2, 1)], "a" * 64, None, "`pipeinfer calibrate m`")
    assert "made by an older pipeinfer" in diff and "run `pipeinfer calibrate m` again" in diff


def test_plan_predicts_the_threads_generate_would_use(monkeypatch):
    """default_threads is `generate`'s default, computed from the CPU share calibrate recorded: on
    this machine it must agree with runtime/topology.default_threads, with and without the whole
    host that generate --ranks N gives an iterative job."""
    from pipeinfer_cli.runtime.topology import WHOLE_HOST_ENV
    from pipeinfer_cli.runtime.topology import default_threads as job_default

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    f = host_facts()
    share = (f.cores, f.affinity_cpus, f.quota_cpus)
    for n, per_host in ((1, 1), (2, 2), (2, 1), (4, 4)):
        assert default_threads(False, n, per_host, *share, per_host == n) == job_default(per_host, {})
    assert default_threads(True, 2, 2, *share, True) == job_default(2, {WHOLE_HOST_ENV: "1"})
    # the shapes of other machines: a quota shared by the ranks of a host, a launcher's binding
    assert default_threads(False, 2, 2, 8, 8, 3.0, False) == 2 and default_threads(True, 2, 2, 8, 8, 3.0, True) == 3
    assert default_threads(False, 4, 4, 16, 4, None, False) == 4 and default_threads(False, 2, 2, 16, 16, None, True) == 8
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")  # the user's own policy: no whole-host default
    assert default_threads(True, 2, 2, 8, 8, None, True) == 4


def test_plan_refuses_a_profile_of_other_threads(smollm2_path, tmp_path):
    prof = smollm2_profile(smollm2_path, tmp_path, threads=1)
    err = one_line_error(run("plan", smollm2_path, "--profile", prof, "-p", "Hi", "-n", 4))
    assert "the profile was made for 1 thread per rank, this job uses 2" in err
    assert "--threads 2" in err and "or plan (and run) the job with --threads 1" in err and "--force" in err
    ok = run("plan", smollm2_path, "--profile", prof, "-p", "Hi", "-n", 4, "--threads", "1", "--json")
    assert ok.returncode == 0, ok.stderr
    forced = run("plan", smollm2_path, "--profile", prof, "-p", "Hi", "-n", 4, "--force", "--json")
    assert forced.returncode == 0, forced.stderr
    assert "warning: the profile was made for 1 thread per rank" in forced.stderr and "--force" in forced.stderr


def test_iterative_on_one_host_is_planned_with_all_the_cores(smollm2_path, tmp_path, monkeypatch):
    """Two ranks on this host, measured with their share of the cores: iterative's job gives each
    rank all the cores (generate --ranks 2), which the profile did not measure; the other modes fit."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    f = host_facts()
    cores, share = f.cores, max(1, f.cores // 2)
    if cores < 2 or f.usable_cpus < cores or f.quota_cpus is not None:
        pytest.skip("needs a machine whose 2+ CPUs this process may all use")
    prof = smollm2_profile(smollm2_path, tmp_path, host=f.host, cpu=f.cpu, cores=cores,
                           usable_cpus=f.usable_cpus, threads=share, ranks_per_host=2)
    err = one_line_error(run("plan", smollm2_path, "--profile", prof, "--draft", "lookup", "-p", "Hi", "-n", 4))
    assert f"Error: iterative: the profile was made for {share} thread" in err and f"this job uses {cores}" in err
    assert "or plan --modes speculative,pipeinfer alone" in err
    ok = run("plan", smollm2_path, "--profile", prof, "--draft", "lookup", "-p", "Hi", "-n", 4, "--modes",
             "speculative,pipeinfer", "--json")
    assert ok.returncode == 0, ok.stderr


def test_ranks_per_host_and_the_machine_must_match(smollm2_path, tmp_path):
    f = host_facts()
    prof = smollm2_profile(smollm2_path, tmp_path, host=f.host, cpu="another cpu", usable_cpus=f.usable_cpus,
                           cores=f.cores, ranks_per_host=1)
    err = one_line_error(run("plan", smollm2_path, "--profile", prof, "-p", "Hi", "-n", 4, "--modes", "pipeinfer",
                             "--draft", "lookup", "--threads", "2"))
    assert "shared its host with 0 other ranks, in this job it shares it with 1" in err
    assert f"CPU another cpu (now {f.cpu})" in err


def test_an_older_profile_or_another_file_is_refused_unless_forced(smollm2_path, tmp_path):
    prof = smollm2_profile(smollm2_path, tmp_path)
    d = json.loads(prof.read_text())
    d["model"]["sha256"] = None
    prof.write_text(json.dumps(d))
    err = one_line_error(run("plan", smollm2_path, "--profile", prof, "-p", "Hi", "-n", 4))
    assert "made by an older pipeinfer" in err and "pipeinfer calibrate" in err
    d["model"]["sha256"] = "f" * 64
    prof.write_text(json.dumps(d))
    err = one_line_error(run("plan", smollm2_path, "--profile", prof, "-p", "Hi", "-n", 4))
    assert "another file of the model" in err
    assert run("plan", smollm2_path, "--profile", prof, "-p", "Hi", "-n", 4, "--force").returncode == 0


def test_a_trace_carries_the_models_identity(smollm2_path, tmp_path):
    prof = smollm2_profile(smollm2_path, tmp_path)
    trace = tmp_path / "t.trace"
    r = run("plan", smollm2_path, "--profile", prof, "-p", "Hi", "-n", 4, "--record", trace)
    assert r.returncode == 0, r.stderr
    t = json.loads(trace.read_text())
    assert t["model"]["sha256"] == model_sha256(smollm2_path)
    assert t["machine"]["host"] == host_facts().host and t["machine"]["threads"] >= 1
    t["model"]["sha256"] = "0" * 64
    trace.write_text(json.dumps(t))
    err = one_line_error(run("plan", smollm2_path, "--profile", prof, "--trace", trace))
    assert "recorded with another file of" in err and "--record" in err
    del t["model"]["sha256"]
    trace.write_text(json.dumps(t))
    assert "recorded by an older pipeinfer" in one_line_error(run("plan", smollm2_path, "--profile", prof,
                                                                  "--trace", trace))


# -- memory -------------------------------------------------------------------------------------
def test_the_kv_cache_and_ranks_sharing_a_host_count(smollm2_path):
    info = read_model_info(smollm2_path)
    assert info.kv_bytes_per_cell == 2 * 2 * info.n_head_kv * info.n_embd_head  # K and V, f16
    prof = make_profile(2, n_layer=info.n_layer, sha256="a" * 64)
    prof.model.layer_bytes, prof.model.output_bytes = info.layer_bytes, info.output_bytes
    weights = sum(info.layer_bytes) + info.output_bytes
    kv = JobMemory(4096, info.kv_bytes_per_cell)
    total = weights + kv.kv_bytes(info.n_layer)

    def hosts_hold(n_bytes: float) -> None:
        for rc in prof.ranks:
            rc.mem_available_bytes = int(n_bytes / 0.9)

    hosts_hold(0.6 * weights)  # the weights fit on two hosts, not with their KV cache at 4096 cells
    assert auto_split(prof, [0, 1])[-1][1] == info.n_layer
    with pytest.raises(UsageError, match=r"rank 1 \(host node1\) cannot hold layers \d+-29, KV cache at --ctx 4096"):
        auto_split(prof, [0, 1], mem=kv)
    hosts_hold(0.6 * total)  # with it, they do
    assert auto_split(prof, [0, 1], mem=kv)[-1][1] == info.n_layer
    for rc in prof.ranks:  # both ranks on one host: each has half of it
        rc.host, rc.ranks_per_host = "node0", 2
    with pytest.raises(UsageError) as e:
        auto_split(prof, [0, 1], mem=kv)
    msg = str(e.value)
    assert msg.startswith("--layer-split auto: rank 1 (host node0) cannot hold layers ") and "it needs" in msg
    assert "shared by 2 ranks" in msg and "smaller --ctx" in msg and "auto/1" in msg


def test_the_draft_weighs_on_the_rank_that_runs_it():
    prof = make_profile(2, n_layer=10, sha256="a" * 64)  # 100 bytes per layer, 100 of LM head
    for rc in prof.ranks:
        rc.mem_available_bytes = 1000
    # 900 bytes each; a 600-byte draft on the head leaves it room for 3 layers only.
    assert auto_split(prof, [0, 1], mem=JobMemory(0, 0, 600)) == [(0, 3), (3, 10)]
    with pytest.raises(UsageError, match="rank 1 .* cannot hold the draft model"):
        auto_split(prof, [0], mem=JobMemory(0, 0, 950, draft_rank=1))


def test_generate_refuses_an_auto_split_that_does_not_fit(smollm2_path, tmp_path):
    prof = smollm2_profile(smollm2_path, tmp_path, mem_available_bytes=150 << 20)
    err = one_line_error(run("generate", smollm2_path, "--ranks", "2", "--layer-split", "auto", "--profile", prof,
                             "--ctx", "131072", "-p", "Hi", "-n", 2))
    assert "--layer-split auto: rank" in err and "KV cache at --ctx 131072" in err and "it needs" in err


# -- -M auto ------------------------------------------------------------------------------------
def test_mode_auto_states_its_acceptance_once(smollm2_path, tmp_path):
    prof = smollm2_profile(smollm2_path, tmp_path)
    r = run("generate", smollm2_path, "--draft", "lookup", "-M", "auto", "--profile", prof, "-p", "1, 2, 3,", "-n", 4)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("pipeinfer: -M auto chose ")]
    assert len(lines) == 1 and "on a measured acceptance of" in lines[0], r.stderr  # prompt lookup, on the prompt
    assert "(measured on the prompt: lookup " in lines[0], r.stderr
    assert lines[0].endswith("run with the profile's --threads 2"), r.stderr  # what the profile measured
    # --threads other than the profile's: planned at those threads, the costs extrapolated, and said so.
    r = run("generate", smollm2_path, "--draft", "lookup", "-M", "auto", "--profile", prof, "--threads", "1",
            "-p", "Hi", "-n", 2, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["auto"]["threads"] == "1"
    assert "run with --threads 1 (the profile measured 2: costs extrapolated" in r.stderr, r.stderr
    assert "60%" in run("generate", "--help").stdout


def test_how_the_ranks_wait_between_graphs_must_match(monkeypatch):
    """An iterative job on one host at its default threads gives each rank its host's CPUs and a
    brief spin (OMP_WAIT_POLICY=active, bounded): a profile whose ranks of several threads waited
    passively measured them ~1.4x slower, and `plan` predicted the job below its own 1-thread
    prediction. Such a difference is named with its fix; a profile that waited as the job does plans it."""
    from pipeinfer_cli.cli.plan_checks import job_shapes

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)

    def profile(wait):
        ranks = [dataclasses.replace(rank_costs(r), host="nodeA", threads=2, usable_cpus=2.0, ranks_per_host=2,
                                     omp_wait=wait) for r in range(2)]
        return make_profile(2, ranks=ranks, sha256="a" * 64)

    cmd = "`pipeinfer calibrate m --ranks 2 --threads 2`"
    shapes = job_shapes(profile("active"), "iterative", None, 2)
    assert [(s.threads, s.omp_wait) for s in shapes] == [(2, "active"), (2, "active")]
    assert differences(profile("active"), shapes, "a" * 64, None, cmd) == []
    (diff,) = differences(profile("passive"), shapes, "a" * 64, None, cmd)
    assert "waited between graphs with OMP_WAIT_POLICY=passive, this job's ranks wait with active" in diff
    assert "without OMP_WAIT_POLICY in the environment" in diff
    # the same threads given explicitly: that job's ranks share the host and wait passively
    explicit = job_shapes(profile("active"), "iterative", "2", 2)
    assert [s.omp_wait for s in explicit] == ["passive", "passive"]
    assert "with OMP_WAIT_POLICY=passive set" in differences(profile("active"), explicit, "a" * 64, None, cmd)[0]
    assert differences(profile(None), explicit, "a" * 64, None, cmd) == []  # an older profile: not compared


def test_calibrate_s_ranks_with_the_host_s_cpus_wait_as_the_iterative_job_s(monkeypatch):
    from pipeinfer_cli.cli import calibrate_cmd
    from pipeinfer_cli.runtime import cpu_share

    share = cpu_share.cpu_share()
    monkeypatch.setattr(cpu_share, "cpu_share", lambda *a, **k: dataclasses.replace(share, affinity_cpus=2,
                                                                                     host_cpus=2, quota_cpus=None))
    assert cpu_share.cpu_share().threads == 2
    env = {}
    assert calibrate_cmd.waits_as_iterative("2", 2, env)
    assert not calibrate_cmd.waits_as_iterative("1", 2, env)  # their share: they wait passively, as that job's
    assert not calibrate_cmd.waits_as_iterative(None, 2, env)
    assert not calibrate_cmd.waits_as_iterative("2", 1, env)
    assert not calibrate_cmd.waits_as_iterative("2", 2, {"OMP_WAIT_POLICY": "passive"})
