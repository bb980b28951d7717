"""`--mode pipeinfer` under real mpiexec: lossless against iterative, cancellation really happens,
perfect drafts are all accepted, long generations keep the KV cache exact, and faults end the job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import lru_cache

import pytest


pytestmark = pytest.mark.mpi

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"


def generate(model, *args, env=None, timeout=180) -> dict:
    cmd = [sys.executable, "-m", "pipeinfer_cli", "generate", str(model), "--json", "--ctx", "1024", *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@lru_cache(maxsize=None)
def reference(model: str, n: int, sampling: tuple, prompt: str = PROMPT) -> tuple[int, ...]:
    """Tokens of plain iterative decoding on one rank (the ground truth)."""
    return tuple(generate(model, "-p", prompt, "-n", n, *sampling)["tokens"])


GREEDY = ()
TEMP = ("--temp", "0.8", "--seed", "7")


@pytest.mark.parametrize("ranks, draft, sampling, branches", [
    (2, "self", GREEDY, 1),
    (3, "lookup", GREEDY, 1),
    (2, "lookup", TEMP, 1),
    (3, "self", TEMP, 1),
    (2, "self", GREEDY, 3),
    (3, "lookup", TEMP, 3),
])
def test_pipeinfer_is_lossless_on_smollm2(smollm2_path, ranks, draft, sampling, branches):
    want = reference(str(smollm2_path), 40, sampling)
    got = generate(smollm2_path, "-p", PROMPT, "-n", 40, *sampling, "--mode", "pipeinfer", "--ranks", ranks,
                   "--draft", smollm2_path if draft == "self" else draft, "--max-branches", branches)
    assert tuple(got["tokens"]) == want
    assert got["n_gen"] == len(want)


@pytest.mark.parametrize("ranks, sampling, branches", [(2, GREEDY, 1), (3, GREEDY, 3), (2, TEMP, 1), (3, TEMP, 1)])
def test_pipeinfer_is_lossless_on_tiny_qwen2_with_a_poor_draft(tiny_pair, ranks, sampling, branches):
    target, draft = tiny_pair
    want = reference(str(target), 48, sampling)
    got = generate(target, "-p", PROMPT, "-n", 48, *sampling, "--mode", "pipeinfer", "--ranks", ranks,
                   "--draft", draft, "--p-accept", "0", "--max-branches", branches)
    assert tuple(got["tokens"]) == want
    # A random draft is nearly always wrong: runs must have been rejected and cancelled.
    assert got["acceptance"]["drafted"] > got["acceptance"]["accepted"]
    assert got["runs"]["cancelled"] > 0


def test_cancellation_is_real(smollm2_path):
    """A poor draft makes the head cancel runs; stages drop them before or during compute."""
    want = reference(str(smollm2_path), 64, GREEDY)
    got = generate(smollm2_path, "-p", PROMPT, "-n", 64, "--mode", "pipeinfer", "--ranks", 3, "--draft", "lookup",
                   "--p-accept", "0", "--n-draft", 6)
    assert tuple(got["tokens"]) == want
    runs = got["runs"]
    assert runs["cancelled"] > 0
    assert runs["cancelled_mid_compute"] > 0
    # The native engines' own counters show that layers of cancelled runs were not computed.
    stages = [r for r in got["ranks"] if r["role"] == "stage"]
    assert sum(r["engine"]["layer_evals_skipped"] for r in stages) == runs["layer_evals_skipped"] > 0
    assert sum(r["engine"]["evals_cancelled"] for r in stages) >= runs["cancelled_mid_compute"]


def test_perfect_draft_is_always_accepted(smollm2_path):
    """Draft == target at temperature 0: every drafted token is accepted and nothing is cancelled."""
    got = generate(smollm2_path, "-p", PROMPT, "-n", 40, "--mode", "pipeinfer", "--ranks", 2, "--draft", smollm2_path,
                   "--p-accept", "0")
    acc = got["acceptance"]
    assert acc["drafted"] > 0 and acc["accepted"] == acc["drafted"] and acc["rate"] == 1.0
    # Only runs still in flight when the text ended may be cancelled; none was rejected.
    assert got["runs"]["cancelled"] == got["runs"]["cancelled_at_end"]
    assert tuple(got["tokens"]) == reference(str(smollm2_path), 40, GREEDY)


def test_long_generation_keeps_kv_exact(smollm2_path):
    """512 tokens recycle sequence slots; afterwards every rank's cache holds exactly the committed tokens."""
    prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
    got = generate(smollm2_path, "-p", prompt, "-n", 512, "--mode", "pipeinfer", "--ranks", 2, "--draft", "lookup",
                   "--p-accept", "0", "--max-inflight", 4)
    assert got["n_gen"] == 512
    assert got["runs"]["launched"] > 8  # many more runs than sequence slots: slots were recycled
    for r in got["ranks"]:
        assert r["kv_used_cells"] == got["n_prompt"] + got["n_gen"] - 1, r
    assert tuple(got["tokens"]) == reference(str(smollm2_path), 512, GREEDY, prompt)


def test_stage_failure_mid_run_ends_the_job(smollm2_path):
    cmd = [sys.executable, "-m", "pipeinfer_cli", "generate", str(smollm2_path), "-p", PROMPT, "-n", 64,
           "--mode", "pipeinfer", "--draft", "lookup", "--ranks", "3"]
    r = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=30,
                       env={**os.environ, "PIPEINFER_DEBUG_FAIL": "2:4"})
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "rank 2" in errors[0] and "injected fault" in errors[0]
    assert "Traceback" not in r.stderr


# -- token trees ------------------------------------------------------------------------------
TREES = ("--p-split", "0.05", "--max-branches", "3", "--p-accept", "0")


@pytest.mark.parametrize("ranks, sampling", [(2, GREEDY), (3, GREEDY), (2, TEMP), (3, TEMP)])
def test_token_trees_are_lossless_on_smollm2(smollm2_path, ranks, sampling):
    """SmolLM2 drafting for itself, with trees: the tokens of plain decoding, and trees were really used."""
    want = reference(str(smollm2_path), 40, sampling)
    got = generate(smollm2_path, "-p", PROMPT, "-n", 40, *sampling, "--mode", "pipeinfer", "--ranks", ranks,
                   "--draft", smollm2_path, *TREES)
    assert tuple(got["tokens"]) == want
    runs = got["runs"]
    assert runs["branches_launched"] > 0
    assert runs["branches_cancelled"] <= runs["branches_launched"]
    # KV multibuffering stays exact with trees: every rank holds just the committed tokens.
    for r in got["ranks"]:
        assert r["kv_used_cells"] == got["n_prompt"] + got["n_gen"] - 1, r


@pytest.mark.parametrize("ranks, sampling", [(2, GREEDY), (2, TEMP), (3, TEMP)])
def test_token_trees_are_lossless_with_a_poor_draft(tiny_pair, ranks, sampling):
    """A random draft: nearly every branch is wrong; p_split 0 splits every run that can split."""
    target, draft = tiny_pair
    want = reference(str(target), 48, sampling)
    got = generate(target, "-p", PROMPT, "-n", 48, *sampling, "--mode", "pipeinfer", "--ranks", ranks,
                   "--draft", draft, "--p-accept", "0", "--p-split", "0", "--max-branches", "3")
    assert tuple(got["tokens"]) == want
    assert got["runs"]["branches_launched"] > 0
    assert got["runs"]["cancelled"] > 0


def test_lookup_trees_split_where_earlier_occurrences_disagree(smollm2_path):
    """"is" was followed by " Paris" and by " Rome": the lookup drafter offers both, a tree verifies
    both, and the output is still plain decoding's."""
    got = generate(smollm2_path, "-p", PROMPT, "-n", 32, "--mode", "pipeinfer", "--ranks", 2, "--draft", "lookup",
                   "--p-accept", "0", "--p-split", "0", "--max-branches", "3")
    assert tuple(got["tokens"]) == reference(str(smollm2_path), 32, GREEDY)
    assert got["runs"]["branches_launched"] > 0
    for r in got["ranks"]:
        assert r["kv_used_cells"] == got["n_prompt"] + got["n_gen"] - 1, r


# -- asynchronous drafting on a dedicated draft rank ---------------------------------------------
@pytest.mark.parametrize("split, sampling", [("1/1", GREEDY), ("0.5,0.5/1", GREEDY), ("0.5,0.5/1", TEMP)])
def test_async_draft_rank_is_lossless(smollm2_path, split, sampling):
    want = reference(str(smollm2_path), 40, sampling)
    got = generate(smollm2_path, "-p", PROMPT, "-n", 40, *sampling, "--mode", "pipeinfer", "--layer-split", split,
                   "--draft", smollm2_path, "--p-accept", "0")
    assert tuple(got["tokens"]) == want
    draft_ranks = [r for r in got["ranks"] if r["role"] == "draft"]
    assert len(draft_ranks) == 1 and draft_ranks[0]["runs"] > 0  # the draft rank answered requests


@pytest.mark.parametrize("split", ["1/1", "0.5,0.5/1"])
def test_async_draft_rank_with_a_poor_draft(tiny_pair, split):
    """Stale or wrong replies are dropped, wrong runs cancelled; the tokens never change."""
    target, draft = tiny_pair
    want = reference(str(target), 48, TEMP)
    got = generate(target, "-p", PROMPT, "-n", 48, *TEMP, "--mode", "pipeinfer", "--layer-split", split,
                   "--draft", draft, "--p-accept", "0")
    assert tuple(got["tokens"]) == want
    draft_ranks = [r for r in got["ranks"] if r["role"] == "draft"]
    assert len(draft_ranks) == 1 and draft_ranks[0]["runs"] > 0


# -- where each rank's CPU goes --------------------------------------------------------------------
def test_every_rank_reports_where_its_cpu_went(smollm2_path):
    """A head, a stage and a draft rank: each one's cpu_s cut into its layers, the draft model and
    the rest, adding up to cpu_s (to its rounding); the draft model's CPU only on the draft rank."""
    want = reference(str(smollm2_path), 40, GREEDY)
    got = generate(smollm2_path, "-p", PROMPT, "-n", 40, "--mode", "pipeinfer", "--layer-split", "0.5,0.5/1",
                   "--draft", smollm2_path)
    assert tuple(got["tokens"]) == want
    roles = {}
    for r in got["ranks"]:
        split = r["cpu_split"]
        assert set(split) == {"stage_s", "draft_s", "own_s", "own_wait_s"}
        assert all(v >= 0 for v in split.values()) and split["own_wait_s"] <= split["own_s"]
        assert split["stage_s"] + split["draft_s"] + split["own_s"] == pytest.approx(r["cpu_s"], abs=2e-3)
        assert r["wire"]["wakeups"] >= 0
        roles[r["role"]] = split
    assert roles["head"]["stage_s"] > 0 and roles["head"]["draft_s"] == 0
    assert roles["stage"]["stage_s"] > 0 and roles["stage"]["draft_s"] == 0
    assert roles["draft"]["draft_s"] > 0 and roles["draft"]["stage_s"] == 0  # its prompt pass at least
    d = got["drafting"]
    assert d["proposed"] >= d["launched"] >= got["acceptance"]["drafted"]
    assert d["proposed_per_committed"] == pytest.approx(d["proposed"] / got["n_gen"])
