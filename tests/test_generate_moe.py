"""`pipeinfer generate` on a mixture-of-experts file, under real mpiexec: every mode on 2 and 3
ranks prints the tokens of iterative decoding on one rank (a tiny qwen3moe file, its own draft), and
bad MoE input ends in one `Error:` line."""

from __future__ import annotations

import json

import pytest

from test_generate_mpi import assert_one_line_error, run
from tinygguf import write_tiny_model

pytestmark = pytest.mark.mpi

MOE = dict(arch="qwen3moe", n_layer=6, n_expert=8, n_expert_used=2, n_ff_exp=32, head_dim=32, seed=11)
ARGS = ["-p", "The capital of France is", "-n", 24, "--ctx", 256, "--threads", 1, "--json"]


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("gen-moe") / "qwen3moe.gguf", **MOE)


def generate(path, ranks: int, mode: str) -> dict:
    draft = [] if mode == "iterative" else ["--draft", path]
    if mode == "pipeinfer":
        draft += ["--p-accept", 0]  # a tiny random model is never confident: speculate anyway
    r = run(path, *ARGS, "--ranks", ranks, "--mode", mode, *draft, timeout=240)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_every_mode_on_two_and_three_ranks_prints_identical_tokens(moe_file):
    want = generate(moe_file, 1, "iterative")["tokens"]
    assert len(want) == 24
    for ranks in (2, 3):
        for mode in ("iterative", "speculative", "pipeinfer"):
            got = generate(moe_file, ranks, mode)
            assert got["tokens"] == want, f"{mode} on {ranks} ranks diverges from iterative on 1 rank"
            assert len(got["ranks"]) == ranks
            if mode != "iterative":
                # The draft is the target itself: every verified draft token is accepted.
                acc = got["acceptance"]
                assert acc["drafted"] > 0 and acc["accepted"] == acc["drafted"], (mode, ranks, acc)


def test_missing_expert_tensor_is_one_error_line(tmp_path):
    path = write_tiny_model(tmp_path / "broken.gguf", **MOE, omit_tensors=("blk.4.ffn_up_exps.weight",))
    r = run(path, "-p", "Hi", "-n", 4, "--threads", 1, "--ranks", 2, timeout=120)
    assert_one_line_error(r, "blk.4.ffn_up_exps.weight", "missing")


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    path = write_tiny_model(tmp_path / "phi.gguf", arch_name="phi3")
    r = run(path, "-p", "Hi", "-n", 4, "--threads", 1, timeout=60)
    assert_one_line_error(r, "'phi3'", "llama", "qwen2", "qwen3", "qwen3moe")


def test_inspect_shows_the_experts(moe_file):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "pipeinfer_cli", "inspect", str(moe_file), "--ranks", "3"]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "8 per layer, 2 used per token, n_ff 32 each" in text
    assert "of which experts" in text
    info = json.loads(subprocess.run([*cmd, "--json"], capture_output=True, text=True, check=True).stdout)
    assert (info["n_expert"], info["n_expert_used"], info["n_ff_exp"]) == (8, 2, 32)
    # the balanced split counts every expert: per rank, its layers' bytes with their experts
    assert all(0 < e < b for e, b in zip(info["expert_bytes"], info["layer_bytes"]))
    for r in info["split"]:
        b, e = r["layers"]
        assert r["layer_bytes"] == sum(info["layer_bytes"][b:e])
    assert [r["n_layers"] for r in info["split"]] == [2, 2, 2]


def test_draft_that_cannot_be_translated_is_refused(moe_file, tmp_path):
    """The draft vocabulary check is the same for a mixture-of-experts target: another vocabulary
    whose tokenizer does not spell text back byte for byte cannot be translated."""
    draft = write_tiny_model(tmp_path / "spm.gguf", arch="qwen3", n_layer=2, n_vocab=512, seed=2, spm=True)
    r = run(moe_file, "-p", "Hi", "-n", 4, "--threads", 1, "--ranks", 2, "--mode", "speculative", "--draft", draft,
            timeout=120)
    assert_one_line_error(r, "byte for byte")
