"""`pipeinfer generate gemma3-270m --draft lookup` under real mpiexec: every mode on 2 and 3 ranks
prints the tokens of plain iterative decoding on one rank (sliding-window attention, a
262,144-token vocabulary, prompt-lookup drafts that are accepted and rejected)."""

from __future__ import annotations

import json

import pytest

from test_generate_mpi import run

PROMPT = "red green blue yellow red green blue yellow red green blue yellow red green"
CONFIGS = [(ranks, mode) for ranks in (2, 3) for mode in ("iterative", "speculative", "pipeinfer")]


def generate(ranks: int, mode: str) -> dict:
    args = ["gemma3-270m", "-p", PROMPT, "-n", 24, "--threads", 1, "--ranks", ranks, "--mode", mode, "--json"]
    if mode != "iterative":
        args += ["--draft", "lookup"]
    r = run(*args, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def reference(gemma3_path) -> dict:
    return generate(1, "iterative")


@pytest.mark.parametrize("ranks, mode", CONFIGS, ids=[f"{m}-{r}" for r, m in CONFIGS])
def test_gemma3_modes_print_identical_tokens(reference, ranks, mode):
    got = generate(ranks, mode)
    assert len(reference["tokens"]) == reference["n_gen"] == 24
    assert got["tokens"] == reference["tokens"]
    assert len(got["ranks"]) == ranks
    if mode != "iterative":
        assert got["acceptance"]["drafted"] > 0
