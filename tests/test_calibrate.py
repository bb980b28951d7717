"""`pipeinfer calibrate` as a user runs it: a real job on SmolLM2 writes a profile the planner reads
(every rank, the links a job uses, positive costs that grow with the rows), the table or the JSON
on stdout; bad input is one `Error:` line before any job starts. Plus the pure parts: the probe's
layer range, the grid's points and the link fit.

No assertion is about speed: the machine may be shared, and the figures are whatever it measured.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jobprocs import finish_job, start_job
from pipeinfer_cli.planner.identity import model_sha256
from pipeinfer_cli.planner.profile import Profile
from pipeinfer_cli.runtime.calibrate_probes import (PROBE_BYTES, QUICK_PROBE_BYTES, ProbeSpec, fit_link, host_facts,
                                                    probe_layers)

JOB_TIMEOUT_S = 240  # --quick on SmolLM2 takes 10-30 s; much longer beside other jobs


def calibrate(*args) -> tuple[int, str, str]:
    proc, marker = start_job([sys.executable, "-m", "pipeinfer_cli", "calibrate", *args])
    return finish_job(proc, marker, JOB_TIMEOUT_S)


def assert_sane(profile: Profile, n_ranks: int) -> None:
    assert [r.rank for r in profile.ranks] == list(range(n_ranks))
    for r in profile.ranks:
        assert r.threads >= 1 and r.cores >= 1 and r.host and r.cpu
        assert r.mem_total_bytes >= r.mem_available_bytes > 0
        assert r.output_row_s >= 0 and r.run_overhead_s >= 0
        assert 0 <= r.probe_layers[0] < r.probe_layers[1] == profile.model.n_layer - 1
        for line in r.decode.s:
            assert all(v > 0 for v in line)
            assert line == sorted(line), r.decode  # a larger batch never costs less (non_decreasing)
        assert r.prefill.kv == [0] and all(v > 0 for v in r.prefill.s[0])


def test_batch_costs_are_made_non_decreasing_in_rows():
    from pipeinfer_cli.runtime.calibrate_probes import non_decreasing

    # A spell of the machine during the 1-row point (as a CI run beside other work once measured).
    assert non_decreasing([13.7e-3, 0.54e-3, 1.24e-3, 0.82e-3, 0.97e-3]) == [0.54e-3, 0.54e-3, 0.82e-3, 0.82e-3, 0.97e-3]
    assert non_decreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]


@pytest.mark.mpi
def test_two_ranks_measure_every_rank_and_both_links(smollm2_path, tmp_path):
    out = tmp_path / "profile.json"
    rc, stdout, stderr = calibrate(smollm2_path, "--ranks", "2", "--quick", "--threads", "1", "--out", out)
    assert rc == 0, stderr
    profile = Profile.load(out)
    assert_sane(profile, 2)
    assert profile.model.n_layer == 30 and profile.model.n_embd == 576
    assert profile.model.file_bytes == smollm2_path.stat().st_size
    assert len(profile.model.layer_bytes) == 30 and profile.model.output_bytes > 0
    profile.check_model(profile.model.name, smollm2_path.stat().st_size)
    assert {(lk.src, lk.dst) for lk in profile.links} == {(0, 1), (1, 0)}
    for lk in profile.links:
        assert lk.latency_s >= 0 and lk.bytes_per_s > 0 and lk.seconds(576 * 4) > 0
    assert profile.draft is None
    # --quick: the batches of --n-draft 4 (1 to 5 rows) at two KV lengths
    assert profile.ranks[0].decode.rows == [1, 2, 3, 4, 5] and profile.ranks[0].decode.kv == [16, 512]
    assert profile.command.startswith("pipeinfer calibrate ")
    # which job it measured: the model's file, and per rank the machine, its threads, its host's ranks
    assert profile.model.sha256 == model_sha256(smollm2_path)
    assert profile.model.kv_bytes_per_cell == 2 * 2 * 3 * 64  # SmolLM2: 3 KV heads of 64, f16 K and V
    facts = host_facts()
    for r in profile.ranks:
        assert (r.threads, r.ranks_per_host, r.cpu, r.cores) == (1, 2, facts.cpu, facts.cores)
        assert 0 < r.usable_cpus <= r.cores
    # the job `generate --ranks 2` runs in iterative mode uses every core per rank: not this profile's
    plan = [sys.executable, "-m", "pipeinfer_cli", "plan", str(smollm2_path), "--profile", str(out), "-p", "Hi",
            "-n", "4"]
    if facts.cores > 1 and facts.usable_cpus >= facts.cores:
        r = subprocess.run(plan, capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and r.stderr.startswith("Error: the profile was made for 1 thread per rank, this job "
                                                         f"uses {facts.cores}"), r.stderr
    r = subprocess.run([*plan, "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "predicted:" in r.stdout, r.stderr
    # the table: a row per rank, a row per link
    assert "ms/layer" in stdout and "overhead" in stdout
    assert "0 -> 1" in stdout and "1 -> 0" in stdout
    # progress on stderr, one line per rank and phase, and where the profile went
    assert "calibrate: rank 0: layers 0-28" in stderr and "calibrate: rank 1: layers 0-28" in stderr
    assert f"profile written to {out}" in stderr
    assert "Traceback" not in stderr


@pytest.mark.mpi
def test_one_rank_with_lookup_prints_the_profile_as_json(smollm2_path, tmp_path):
    out = tmp_path / "one.json"
    rc, stdout, stderr = calibrate(smollm2_path, "--ranks", "1", "--draft", "lookup", "--quick", "--ctx", "300",
                                   "--json", "--out", out)
    assert rc == 0, stderr
    assert json.loads(stdout) == json.loads(out.read_text())
    profile = Profile.load(out)
    assert_sane(profile, 1)
    assert profile.links == []
    d = profile.draft
    assert d.kind == "lookup" and d.rank == 0 and d.token_s > 0 and d.prompt_token_s == 0
    # --ctx caps the grid: KV lengths and batches that fit 300 cells
    assert profile.ranks[0].decode.kv == [16] and profile.ranks[0].prefill.rows == [16, 64, 256]


@pytest.mark.parametrize("args, says", [
    (["no-such-model"], "unknown model 'no-such-model'"),
    (["{model}", "--out", "{tmp}/missing-dir/p.json"], "the directory {tmp}/missing-dir does not exist"),
    (["{model}", "--out", "{tmp}"], "is a directory"),
    (["{model}", "--ranks", "31"], "cannot split 30 layers over 31 ranks"),
    (["{model}", "--layer-split", "1/1"], "has a draft rank ('/1'), which needs a draft"),
])
def test_bad_input_is_one_error_line(smollm2_path, tmp_path, args, says):
    fill = {"model": smollm2_path, "tmp": tmp_path}
    argv = [a.format(**fill) for a in args]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "p.json")]
    rc, stdout, stderr = calibrate(*argv)
    assert rc != 0
    assert stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and says.format(**fill) in lines[0], stderr
    assert not (tmp_path / "p.json").exists()


def test_an_out_path_under_a_file_and_a_broken_profile_are_named_with_the_fix(tmp_path):
    from pipeinfer_cli.cli.calibrate_cmd import check_out_path
    from pipeinfer_cli.errors import UsageError
    from pipeinfer_cli.planner.profile import Profile, ProfileError

    (tmp_path / "afile").write_text("x")
    with pytest.raises(UsageError, match=r"afile is a file, not a directory; choose another path"):
        check_out_path(tmp_path / "afile" / "p.json")
    bad = tmp_path / "p.json"
    bad.write_text('{"ranks": [')
    with pytest.raises(ProfileError, match=r"the profile .*p.json is not valid JSON \(.*\); write one with "
                                           r"`pipeinfer calibrate MODEL --out .*p.json`"):
        Profile.load(bad)


def test_probe_layers_hold_about_the_budget_just_before_the_last_layer():
    mb = 2**20
    assert probe_layers([40 * mb] * 28) == (27 - PROBE_BYTES // (40 * mb), 27)  # 12 layers of 40 MB
    assert probe_layers([40 * mb] * 28, QUICK_PROBE_BYTES) == (24, 27)  # --quick: 3 of them
    assert probe_layers([2 * mb] * 30) == (0, 29)  # a small model: all but the last
    assert probe_layers([900 * mb] * 4) == (2, 3)  # one layer over the budget: still one
    assert probe_layers([1, 1]) == (0, 1)


def test_ranks_on_different_hosts_measure_together_and_ranks_of_one_host_in_turn():
    from pipeinfer_cli.runtime.calibrate import measure_rounds

    assert measure_rounds(["a", "b", "c", "d"]) == [[0, 1, 2, 3]]
    assert measure_rounds(["a", "b", "c", "d", "a"]) == [[0, 1, 2, 3], [4]]
    assert measure_rounds(["vm", "vm", "vm"]) == [[0], [1], [2]]


def test_grid_points_follow_n_draft_and_ctx():
    spec = ProbeSpec("m.gguf", 4096, 4, reps=1, warmup=0, overhead_tokens=1)
    assert spec.decode_rows == [1, 2, 3, 4, 5, 6, 8]
    assert spec.kv_lengths == [16, 256, 1024] and spec.prefill_rows == [16, 64, 256]
    assert spec.probe_ctx() == 1280  # 1024 + 8, rounded up as the engine pads its KV
    assert ProbeSpec("m.gguf", 4096, 1, 1, 0, 1).decode_rows == [1, 2]
    assert ProbeSpec("m.gguf", 4096, 8, 1, 0, 1).decode_rows == [*range(1, 10), 12, 16]
    assert ProbeSpec("m.gguf", 4096, 4, 1, 0, 1, extra_rows=False).decode_rows == [1, 2, 3, 4, 5]
    small = ProbeSpec("m.gguf", 40, 4, 1, 0, 1)
    assert small.kv_lengths == [16] and small.prefill_rows == [16] and small.probe_ctx() == 40
    tiny = ProbeSpec("m.gguf", 16, 4, 1, 0, 1)
    assert tiny.kv_lengths == [8] and tiny.probe_ctx() == 16


def test_link_fit_recovers_latency_and_bandwidth():
    n_embd, lat, bw = 576, 50e-6, 2e9
    one_way = {rows: lat + rows * n_embd * 4 / bw for rows in (1, 8, 64, 256)}
    back = one_way[1]  # the answer is one row
    lk = fit_link(0, 1, n_embd, {rows: t + back for rows, t in one_way.items()})
    assert (lk.src, lk.dst) == (0, 1)
    assert lk.latency_s == pytest.approx(lat, rel=1e-6) and lk.bytes_per_s == pytest.approx(bw, rel=1e-6)
    flat = fit_link(1, 0, n_embd, {1: 2e-4, 8: 2e-4, 64: 1.9e-4, 256: 1.95e-4})  # noise: no slope
    assert flat.latency_s >= 0 and flat.bytes_per_s > 0


def test_an_auto_split_is_calibrated_with_equal_shares_of_the_same_ranks():
    from pipeinfer_cli.errors import UsageError
    from pipeinfer_cli.runtime.calibrate import calibration_split

    assert calibration_split(None, 2) is None
    assert calibration_split("0.3,0.7", 2) == "0.3,0.7"
    assert calibration_split("auto", 3) == "1,1,1"
    assert calibration_split("auto/1", 3) == "1,1/1"
    with pytest.raises(UsageError, match="needs at least 2 ranks"):
        calibration_split("auto/1", 1)
