"""`pipeinfer plan --parallel N` and the split for N requests at once, as a user runs them (SmolLM2,
profiles made by hand with its header's facts, so that nothing here depends on this machine's
speed), and the split `serve --parallel N` takes when none is given."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from planning import make_profile, rank_costs, smollm2_profile
from serving import start_server

from pipeinfer_cli.decode.parallel_policy import DraftLender
from pipeinfer_cli.planner.split import auto_split

PROMPTS = ["1, 2, 3, 4,", "a b c d e", "10 20 30 40", "red green blue red"]


def run(*args, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeinfer_cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def profile_with(model_path, directory, name: str, ranks) -> str:
    """A profile of SmolLM2's header with these ranks' costs."""
    from pipeinfer_cli.models.gguf_info import read_model_info
    from pipeinfer_cli.planner.identity import model_sha256

    info = read_model_info(model_path)
    prof = make_profile(len(ranks), n_layer=info.n_layer, ranks=ranks, file_bytes=info.file_size, latency_s=2e-4,
                        sha256=model_sha256(model_path))
    prof.model.layer_bytes, prof.model.n_embd = info.layer_bytes, info.n_embd
    path = directory / f"{name}.json"
    prof.save(path)
    return str(path)


@pytest.fixture(scope="module")
def profile(smollm2_path, tmp_path_factory):
    """Two ranks, the second twice as slow (tests/planning.py)."""
    return smollm2_profile(smollm2_path, tmp_path_factory.mktemp("plan"))


def equal_ranks(output_row_s: float) -> list:
    """Two ranks of one speed: a layer costs 1 ms per decoded token and 16 ms for a 256-token prompt
    chunk, so a typical request (planner/split.py: 256 prompt tokens, 128 decoded) costs 144 ms
    per layer; the LM head costs output_row_s per row, 129 rows a typical request."""
    from dataclasses import replace

    from pipeinfer_cli.planner.profile import CostGrid

    return [replace(rank_costs(r, output_row_s=output_row_s), prefill=CostGrid([1, 256], [0], [[1e-3, 16e-3]]))
            for r in (0, 1)]


LM_HEAD_ROW_S = 1.44 / 129  # the LM head of a typical request costs 10 layers' time (1.44 s)


@pytest.fixture(scope="module")
def lm_head_profile(smollm2_path, tmp_path_factory):
    """Two equal ranks whose LM head costs as much as 10 layers: balanced in time, 20 + 10."""
    return profile_with(smollm2_path, tmp_path_factory.mktemp("lmhead"), "lmhead", equal_ranks(LM_HEAD_ROW_S))


@pytest.fixture(scope="module")
def trace(smollm2_path, profile, tmp_path_factory):
    """Four short prompts (two clients need more than one), recorded once."""
    d = tmp_path_factory.mktemp("trace")
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    path = d / "t.json"
    r = run("plan", smollm2_path, "--profile", profile, "--prompts", prompts, "-n", 16, "--record", path)
    assert r.returncode == 0, r.stderr
    return path


def plan_json(model, profile, trace, *args) -> dict:
    r = run("plan", model, "--profile", profile, "--trace", trace, "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_two_requests_at_once_predict_more_aggregate_throughput_but_at_most_twice(smollm2_path, profile, trace):
    doc = plan_json(smollm2_path, profile, trace, "--parallel", 2, "--modes", "iterative")
    assert doc["parallel"] == 2 and doc["load_policy"] == "yield"
    p = doc["modes"]["iterative"]
    assert p["n_requests"] == len(PROMPTS) and p["n_gen"] == 16 * len(PROMPTS)
    one = p["one_at_a_time"]["tok_per_s"]
    assert one < p["tok_per_s"] <= 2 * one  # two stages: at most twice one request's
    assert p["vs_one_at_a_time"] == pytest.approx(p["tok_per_s"] / one)
    assert {r["slot"] for r in p["requests"]} == {0, 1}  # both slots served
    assert p["ttft_ms"]["p50"] <= p["ttft_ms"]["p99"] and p["itl_ms"]["p50"] <= p["itl_ms"]["p99"]
    # The figures of one at a time are those of `plan` without --parallel (each prompt alone, in turn).
    alone = plan_json(smollm2_path, profile, trace, "--modes", "iterative")["modes"]["iterative"]
    total_s = sum(x["n_gen"] / x["tok_per_s"] for x in alone["predictions"])
    assert one == pytest.approx(16 * len(PROMPTS) / total_s, rel=1e-6)


def test_the_table_says_what_is_modelled(smollm2_path, profile, trace):
    r = run("plan", smollm2_path, "--profile", profile, "--trace", trace, "--parallel", 2, "--modes", "iterative")
    assert r.returncode == 0, r.stderr
    assert "2 requests at once" in r.stdout and "TTFT p50/p99 ms" in r.stdout and "ITL p50/p99 ms" in r.stdout
    assert "Not modelled:" in r.stdout


def test_the_split_for_two_requests_balances_the_lm_head(smollm2_path, lm_head_profile, trace, tmp_path):
    """Equal ranks: without the LM head's time the split is 15+15; its 10 layers' worth of time on
    the last stage make it 20+10, which is not the byte split either (22+8 for SmolLM2)."""
    free_head = profile_with(smollm2_path, tmp_path, "free", equal_ranks(0.0))
    split_of = lambda prof: plan_json(smollm2_path, prof, trace, "--parallel", 2, "--modes", "iterative",  # noqa: E731
                                      "--layer-split", "auto")["modes"]["iterative"]["settings"]["layer_split"]
    assert split_of(free_head) == "15,15"
    r = run("plan", smollm2_path, "--profile", lm_head_profile, "--trace", trace, "--parallel", 2,
            "--modes", "iterative", "--layer-split", "auto")
    assert r.returncode == 0, r.stderr
    assert "balanced by measured time for 2 requests at once: 20,10" in r.stdout
    assert "the default split, by bytes: 22,8" in r.stdout
    auto = plan_json(smollm2_path, lm_head_profile, trace, "--parallel", 2, "--modes", "iterative",
                     "--layer-split", "auto")["modes"]["iterative"]
    by_bytes = plan_json(smollm2_path, lm_head_profile, trace, "--parallel", 2,
                         "--modes", "iterative")["modes"]["iterative"]
    assert auto["settings"]["layer_split"] == "20,10" and by_bytes["settings"]["layer_split"] == "22,8"
    assert auto["tok_per_s"] > by_bytes["tok_per_s"]  # the balanced stages serve two requests faster


def test_under_load_a_draft_on_the_head_takes_no_layers_from_it(smollm2_path, profile):
    """With as many requests as stages nobody speculates (--load-policy yield), so the draft's time
    on the head does not count; for one request it does."""
    from pipeinfer_cli.planner.profile import Profile

    prof = Profile.load(profile)
    prof.draft.token_s = 20e-3  # as much as 20 of the head's layers per token
    alone = auto_split(prof, [0, 1], draft_on_head=True, parallel=1)
    loaded = auto_split(prof, [0, 1], draft_on_head=True, parallel=2)
    assert loaded == auto_split(prof, [0, 1], draft_on_head=False)
    assert alone[0][1] < loaded[0][1]  # alone, the head keeps fewer layers
    assert auto_split(prof, [0, 1], draft_on_head=True, parallel=3) == loaded
    # round-robin: every request speculates as if alone, and the draft counts; no-spec: it never does.
    assert auto_split(prof, [0, 1], draft_on_head=True, parallel=2, load_policy="round-robin") == alone
    assert auto_split(prof, [0, 1], draft_on_head=True, parallel=2, load_policy="no-spec") == loaded


@pytest.mark.parametrize("args, message", [
    (["--parallel", "0"], "--parallel"),
    (["--parallel", "2", "--search"], "--search looks for the fastest settings of one request at a time"),
    (["--load-policy", "no-spec"], "--load-policy no-spec applies to parallel requests"),
    (["--parallel", "2", "--load-policy", "greedy"], "--load-policy 'greedy' is not one of yield"),
    (["--parallel", "8", "--ctx", "1024"], "--parallel 8 splits --ctx 1024 into slots of fewer than 256 cells"),
])
def test_bad_parallel_values_are_one_error_line(smollm2_path, profile, args, message):
    r = run("plan", smollm2_path, "--profile", profile, "-p", "Hi", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr


# -- the server's default split -----------------------------------------------------------------------
def _job(**kw):
    from pipeinfer_cli.cli.job_options import JobOptions

    return JobOptions(**kw)


def test_the_default_split_rule(monkeypatch):
    from pipeinfer_cli.cli.serve_options import default_split
    from pipeinfer_cli.transport.launch import RELAUNCHED

    for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "PMI_FD", RELAUNCHED,
                "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    job = _job(ranks=2)
    assert default_split(job, 2) == "auto" and job.layer_split == "auto"
    for kw, parallel in (({"ranks": 2}, 1), ({"ranks": 1}, 2), ({}, 2), ({"ranks": 2, "layer_split": "0.6,0.4"}, 2)):
        job = _job(**kw)
        assert default_split(job, parallel) is None and job.layer_split == kw.get("layer_split")  # unchanged
    # Under a launcher of the user's own no calibration can start: auto only with a profile.
    monkeypatch.setenv("PMI_RANK", "0")
    job = _job(ranks=2)
    assert default_split(job, 2) == "bytes" and job.layer_split is None
    job = _job(ranks=2, profile="p.json")
    assert default_split(job, 2) == "auto" and job.layer_split == "auto"
    monkeypatch.setenv(RELAUNCHED, "1")  # a rank of the job pipeinfer started: the launcher resolved the profile
    job = _job(ranks=2)
    assert default_split(job, 2) == "auto"


@pytest.mark.mpi
def test_serve_parallel_two_on_two_ranks_takes_the_split_for_two_requests(smollm2_path, lm_head_profile, tmp_path):
    """No --layer-split: the server runs the split `plan --parallel 2 --layer-split auto` chose (20+10 on
    this profile), says so and names the byte split it did not take (22+8)."""
    server = start_server(smollm2_path, "--ranks", 2, "--threads", 1, "--ctx", 1024, "--parallel", 2,
                          "--profile", lm_head_profile, log_dir=tmp_path)
    try:
        err = server.stderr()
    finally:
        server.stop()
    assert "without --layer-split: the layers go to the stages by measured time for 2 requests at once" in err
    assert "split for 2 requests at once: layers 0-19, 20-29" in err and "by bytes they would be 0-21, 22-29" in err
    assert "0 head (0-19, 1 thread); 1 stage (20-29, 1 thread)" in err  # the banner: what the ranks loaded


def test_the_draft_model_is_lent_to_one_request_at_a_time():
    lender = DraftLender()
    assert lender.take(0, 256) == (True, 0)  # first holder: the draft's cache holds nothing of its slot
    assert lender.take(1, 256) == (False, 256)  # another request meanwhile: the fallback
    lender.give_back(1)  # not the holder: nothing changes
    assert lender.holder == 0
    lender.give_back(0)
    assert lender.take(0, 256) == (True, 256)  # the same slot again: its prefix is still in the draft's cache
    lender.give_back(0)
    assert lender.take(1, 256) == (True, 0)
