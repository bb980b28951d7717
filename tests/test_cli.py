"""The CLI as a user sees it: help, version, errors as one line with a non-zero exit."""

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from pipeinfer_cli import __version__
from pipeinfer_cli.cli.app import app

runner = CliRunner()


def test_help_lists_commands():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    commands = r.output.split("Commands")[1]  # the command list, not the epilog's examples
    for cmd in ("generate", "bench", "inspect", "models"):
        assert f"│ {cmd} " in commands, cmd


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0
    assert r.output.startswith(f"pipeinfer {__version__} (ggml ")


def test_models_list_json():
    r = runner.invoke(app, ["models", "list", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    names = {m["name"] for m in data["models"]}
    assert "qwen2.5-coder-1.5b-instruct" in names
    assert data["pairs"][0]["name"] == "qwen-coder"


def test_unknown_model_is_one_line_error():
    r = runner.invoke(app, ["inspect", "no-such-model"])
    assert r.exit_code == 2  # a usage error, like any misspelled argument
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: unknown model 'no-such-model'")
    assert "smollm2-135m-instruct" in lines[0]


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 definitely not a gguf")
    r = runner.invoke(app, ["inspect", str(p)])
    assert r.exit_code == 1
    assert r.stderr.startswith("Error: ") and "is not a GGUF file" in r.stderr


def test_missing_path(tmp_path):
    r = runner.invoke(app, ["inspect", str(tmp_path / "nope.gguf")])
    assert r.exit_code == 1 and "does not exist" in r.stderr


def test_pull_unknown_model():
    r = runner.invoke(app, ["models", "pull", "nope"])
    assert r.exit_code == 2 and "unknown model 'nope'" in r.stderr


def test_path_of_model_not_downloaded(monkeypatch, tmp_path):
    monkeypatch.setenv("PIPEINFER_CACHE", str(tmp_path))
    r = runner.invoke(app, ["models", "path", "qwen2.5-coder-1.5b-instruct"])
    assert r.exit_code == 1
    assert "run `pipeinfer models pull qwen2.5-coder-1.5b-instruct`" in r.stderr


def _run(args, **env):
    return subprocess.run([sys.executable, "-c", "from pipeinfer_cli.cli.app import main; main()", *args],
                          capture_output=True, text=True, env={**os.environ, **env})


def test_real_process_error_has_no_traceback_unless_debug(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    r = _run(["inspect", str(bad)], PIPEINFER_DEBUG="0")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    r = _run(["inspect", str(bad)], PIPEINFER_DEBUG="1")
    assert r.returncode == 1 and "Traceback" in r.stderr and "Error: " in r.stderr


def test_usage_error_exit_code():
    r = _run(["inspect"])
    assert r.returncode == 2 and "Missing argument" in r.stderr


def test_omp_wait_policy_is_passive_only_where_ranks_share_a_host():
    from pipeinfer_cli.cli.app import omp_wait_policy

    assert omp_wait_policy({}) is None  # alone: libgomp's brief, bounded spin
    assert omp_wait_policy({"MPI_LOCALNRANKS": "1", "PMI_RANK": "0"}) is None  # one rank per node
    assert omp_wait_policy({"MPI_LOCALNRANKS": "3"}) == "passive"
    assert omp_wait_policy({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) == "passive"
    assert omp_wait_policy({"SLURM_NTASKS_PER_NODE": "4"}) == "passive"
    assert omp_wait_policy({"MPI_LOCALNRANKS": "3", "OMP_WAIT_POLICY": "active"}) is None  # the user's choice


def test_iterative_ranks_on_one_machine_get_every_core(monkeypatch):
    """`--ranks N` in iterative mode: one stage computes at a time, so each rank gets all the cores
    (with a bounded spin); the speculative modes, an explicit --threads or OMP_WAIT_POLICY keep theirs."""
    from pipeinfer_cli.cli.generate_cmd import whole_host_threads
    from pipeinfer_cli.decode.modes import needs_draft

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert whole_host_threads(needs_draft("iterative"), None) is True
    assert whole_host_threads(needs_draft("pipeinfer"), None) is False
    assert whole_host_threads(needs_draft("speculative"), None) is False
    assert whole_host_threads(needs_draft("iterative"), "1") is False
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert whole_host_threads(needs_draft("iterative"), None) is False


@pytest.mark.mpi
def test_an_iterative_job_on_two_ranks_runs_each_rank_on_every_core(smollm2_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    r = subprocess.run([sys.executable, "-m", "pipeinfer_cli", "generate", str(smollm2_path), "--ranks", "2",
                        "-n", "4", "-p", "Hello", "--json"], capture_output=True, text=True, timeout=180, env=env, check=False)
    assert r.returncode == 0, r.stderr
    ranks = json.loads(r.stdout)["ranks"]
    assert [rank["threads"] for rank in ranks] == [os.cpu_count()] * 2
    # Two ranks with every core each share the cores: neither may stay awake between messages.
    assert [rank["wait"] for rank in ranks] == ["sleep"] * 2


@pytest.mark.mpi
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core for each of the 2 ranks")
def test_ranks_with_a_core_each_stay_awake_after_a_predicted_sleep_only_when_asked(smollm2_path):
    def job(**env):
        r = subprocess.run([sys.executable, "-m", "pipeinfer_cli", "generate", str(smollm2_path), "--ranks", "2",
                            "--threads", "1", "-M", "iterative", "-n", "24", "-p", "Hello", "--json"],
                           capture_output=True, text=True, timeout=180, check=False, env={**os.environ, **env})
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    asleep, awake = job(), job(PIPEINFER_WAIT_SPIN="tail")
    assert [rank["wait"] for rank in asleep["ranks"]] == ["sleep"] * 2
    assert [rank["wait"] for rank in awake["ranks"]] == ["sleep, then awake up to 10 ms"] * 2
    assert awake["tokens"] == asleep["tokens"]
