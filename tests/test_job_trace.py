"""Traces recorded by a real job (`generate`/`bench --save-trace`, `plan --record --record-ranks N`)
and replayed by `plan --trace`: the acceptance a run measured is the one its trace predicts, and a
split job records the trace one process records (SmolLM2, as target and as draft; a profile made
by hand, so that nothing here depends on this machine's speed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from planning import smollm2_profile
from pipeinfer_cli.planner.identity import model_sha256
from pipeinfer_cli.planner.json_file import write_atomic

CHAT = "Copy this code and add a docstring: def add(a, b): return a + b"
# What replay reads of each prompt (planner/replay.py): equal fields replay equally.
REPLAYED = ("prompt_id", "prompt", "tokens", "finish_reason", "chains_from", "chains", "chain_probs")


def run(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeinfer_cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def profile(smollm2_path, tmp_path_factory):
    """Two ranks on hosts of their own, the second twice as slow, with a draft model's costs."""
    return smollm2_profile(smollm2_path, tmp_path_factory.mktemp("jobtrace"))


def generate_with_trace(model, draft, out, *args) -> dict:
    r = run("generate", model, "--draft", draft, "--ranks", 2, "-M", "speculative", "--save-trace", out, "--json", *args)
    assert r.returncode == 0, r.stderr
    assert f"trace written to {out}" in r.stderr
    return json.loads(r.stdout)


def planned(model, profile, draft, trace, mode="speculative") -> dict:
    r = run("plan", model, "--profile", profile, "--draft", draft, "--trace", trace, "--modes", mode, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["modes"][mode]


def test_a_two_rank_runs_trace_predicts_the_acceptance_it_measured(smollm2_path, profile, tmp_path):
    """Speculative decoding asks the draft the same paths in the run and in the replay: the same
    draft tokens are drafted and accepted (lookup: right 8 times in 18 here, not every time)."""
    trace = tmp_path / "lookup.trace"
    ran = generate_with_trace(smollm2_path, "lookup", trace, "--chat", CHAT, "-n", 40)
    t = json.loads(trace.read_text())
    assert t["depth"] == 0 and t["prompts"][0]["tokens"] == ran["tokens"]
    assert t["model"]["sha256"] == model_sha256(smollm2_path) and t["draft"]["kind"] == "lookup"
    assert [r["layers"] for r in t["machine"]["ranks"]] == [r["layers"] for r in ran["ranks"]]
    pred = planned(smollm2_path, profile, "lookup", trace)
    assert 0 < ran["acceptance"]["accepted"] < ran["acceptance"]["drafted"]
    assert (pred["acceptance"]["drafted"], pred["acceptance"]["accepted"]) == (ran["acceptance"]["drafted"],
                                                                             ran["acceptance"]["accepted"])
    assert pred["n_gen"] == ran["n_gen"]


def test_a_draft_models_chains_come_from_the_jobs_draft(smollm2_path, profile, tmp_path):
    trace = tmp_path / "model.trace"
    ran = generate_with_trace(smollm2_path, smollm2_path, trace, "-p", "The capital of France is", "-n", 16)
    t = json.loads(trace.read_text())
    pt = t["prompts"][0]
    assert t["depth"] == 24 and t["draft"]["sha256"] == model_sha256(smollm2_path)
    assert len(pt["chains"]) == len(pt["prompt"]) + len(pt["tokens"]) - pt["chains_from"]
    pred = planned(smollm2_path, profile, smollm2_path, trace)
    assert pred["draft_misses"] == 0
    assert pred["acceptance"]["drafted"] == ran["acceptance"]["drafted"] > 0
    assert pred["acceptance"]["accepted"] == ran["acceptance"]["accepted"]


def test_plan_record_on_a_split_job_equals_the_one_process_recording(smollm2_path, profile, tmp_path):
    """plan --record with a model draft, on one process and on an MPI job of 2 ranks (and generate
    with the draft on a rank of its own): the same tokens, chains and probabilities (what replay
    reads), the same identities, the same plan."""
    common = ("plan", smollm2_path, "--profile", profile, "--draft", smollm2_path, "-p", "Write a haiku about the sea.",
              "-n", 10, "--modes", "speculative", "--json")
    one = run(*common, "--record", tmp_path / "one.trace")
    split = run(*common, "--record", tmp_path / "split.trace", "--record-ranks", 2)
    assert one.returncode == 0 and split.returncode == 0, one.stderr + split.stderr
    assert "recording the trace on an MPI job of 2 ranks" in split.stderr
    a, b = (json.loads((tmp_path / f"{n}.trace").read_text()) for n in ("one", "split"))
    assert (a["depth"], a["model"], a["draft"]) == (b["depth"], b["model"], b["draft"]) and a["depth"] == 24
    assert len(a["prompts"]) == len(b["prompts"]) == 1
    for k in REPLAYED:
        assert a["prompts"][0][k] == b["prompts"][0][k], k
    assert len(b["machine"]["ranks"]) == 2
    pa, pb = (json.loads(r.stdout)["modes"]["speculative"] for r in (one, split))
    assert pa["acceptance"] == pb["acceptance"] and pa["tok_per_s"] == pb["tok_per_s"]
    # The draft on a rank of its own answers the head's chain requests over the wire: the same chains.
    rank = tmp_path / "draft-rank.trace"
    r = run("generate", smollm2_path, "--draft", smollm2_path, "--layer-split", "0.5,0.5/1", "-M", "iterative",
            "-p", "Write a haiku about the sea.", "-n", 10, "--save-trace", rank)
    assert r.returncode == 0, r.stderr
    c = json.loads(rank.read_text())
    assert [x["role"] for x in c["machine"]["ranks"]] == ["head", "stage", "draft"]
    for k in REPLAYED:
        assert a["prompts"][0][k] == c["prompts"][0][k], k


def test_a_recording_job_that_fails_says_why_in_one_error_line(smollm2_path, profile):
    r = run("plan", smollm2_path, "--profile", profile, "-p", "one two three four five six seven eight nine ten eleven twelve", "-n", 6,
            "--record-ranks", 2, "--ctx", 16)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "--ctx 16" in errors[0], r.stderr


def test_bench_saves_one_trace_per_prompt(smollm2_path, tmp_path):
    out = tmp_path / "bench.trace"
    r = run("bench", smollm2_path, "--modes", "iterative", "--draft", smollm2_path, "--limit", 2, "-n", 6,
            "--warmup", 0, "--ranks", 2, "--save-trace", out)
    assert r.returncode == 0, r.stderr
    t = json.loads(out.read_text())
    assert [len(p["tokens"]) for p in t["prompts"]] == [6, 6] and t["depth"] == 24
    assert len({p["prompt_id"] for p in t["prompts"]}) == 2 and all(p["chains"] for p in t["prompts"])


@pytest.mark.parametrize("args, message", [
    (["generate", "-p", "Hi", "--temp", "0.7", "--save-trace", "t.trace"], "--save-trace records greedy decoding"),
    (["generate", "-p", "Hi", "--save-trace", "/nonexistent/dir/t.trace"], "--save-trace"),
    (["bench", "--concurrency", "1", "--save-trace", "t.trace"], "cannot be written with --concurrency"),
])
def test_save_trace_bad_input_is_one_line(smollm2_path, args, message):
    r = run(args[0], smollm2_path, *args[1:])
    assert message in one_line_error(r)


def test_plan_refuses_a_trace_without_the_chains_it_needs(smollm2_path, profile, tmp_path):
    trace = tmp_path / "tokens.trace"
    generate_with_trace(smollm2_path, "lookup", trace, "-p", "1, 2, 3, 1, 2,", "-n", 6)
    err = one_line_error(run("plan", smollm2_path, "--profile", profile, "--draft", smollm2_path, "--trace", trace,
                             "--modes", "speculative"))
    assert "holds no draft model's chains" in err and "--acceptance" in err
    err = one_line_error(run("plan", smollm2_path, "--profile", profile, "--trace", trace, "--record-ranks", 2))
    assert "--trace already holds its prompts" in err
    r = run("plan", smollm2_path, "--profile", profile, "--draft", smollm2_path, "--trace", trace, "--modes",
            "speculative", "--acceptance", 0.7, "--json")
    assert r.returncode == 0, r.stderr


def test_a_trace_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "t.trace"
    write_atomic(path, "old\n")

    def interrupted(_fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, "new, but cut short\n")
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["t.trace"]
    monkeypatch.undo()
    write_atomic(path, "new\n")
    assert path.read_text() == "new\n" and os.listdir(tmp_path) == ["t.trace"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def test_a_sigterm_while_writing_leaves_the_previous_trace(tmp_path, monkeypatch):
    """A job's ranks are stopped by SIGTERM (Ctrl-C at the launching terminal): mid-write, the
    temporary file goes and the previous file stays; the handler before the write is back after it."""
    path = tmp_path / "t.trace"
    write_atomic(path, "old\n")
    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(os, "fsync", lambda _fd: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, "new\n")
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["t.trace"]
    assert signal.getsignal(signal.SIGTERM) is before


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
