"""Drafts of another vocabulary and hybrid drafting through the CLI, on real models and real
mpiexec jobs: every mode prints exactly iterative's tokens (greedy and seeded; 1-3 ranks and a
draft rank), the JSON says how the draft's tokens reached the target, and a draft whose tokenizer
cannot spell text back is refused in one line.

SmolLM2-135M is the target where it can be (cheap), Gemma 3 270M its draft (262,144 tokens
against 49,152, SentencePiece against byte-level BPE); one check runs the pair this is for,
Qwen2.5-Coder-1.5B with SmolLM2 drafting.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import lru_cache

import pytest

from tinygguf import write_tiny_model

pytestmark = pytest.mark.mpi

# Multi-byte characters (SmolLM2 spells the emoji and the CJK in byte tokens, Gemma in whole
# characters), so paths end inside a character and tokens end inside words.
PROMPT = "Write a haiku about the sea 🌊 and 東京. Then list three fruits:"
# An answer that copies the prompt (make demo's request): lookup has confident matches, the model
# drafts the rest.
COPY = ("Add type hints and a docstring to this Python function, and return the whole function:\n\n"
        "def is_prime(n):\n    if n < 2:\n        return False\n    for i in range(2, int(n ** 0.5) + 1):\n"
        "        if n % i == 0:\n            return False\n    return True\n")
GREEDY = ()
SEEDED = ("--temp", "0.8", "--seed", "7")


def generate(model, *args, timeout=180) -> dict:
    cmd = [sys.executable, "-m", "pipeinfer_cli", "generate", str(model), "--json", "--ctx", "1024", *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@lru_cache(maxsize=None)
def reference(model: str, prompt: str, n: int, sampling: tuple, how: str = "-p") -> tuple[int, ...]:
    return tuple(generate(model, how, prompt, "-n", n, *sampling)["tokens"])


CASES = [  # mode, topology and policy, sampling
    ("speculative", ("--ranks", 1), GREEDY),
    ("pipeinfer", ("--ranks", 1, "--spec-policy", "always"), SEEDED),
    ("pipeinfer", ("--ranks", 2, "--max-branches", 3, "--p-accept", 0.2), GREEDY),  # token trees
    ("pipeinfer", ("--ranks", 3), SEEDED),
    ("pipeinfer", ("--layer-split", "1/1"), GREEDY),
    ("speculative", ("--layer-split", "1/1"), SEEDED),
]


@pytest.mark.parametrize("mode, topo, sampling", CASES, ids=lambda v: " ".join(map(str, v)) if isinstance(v, tuple) else v)
def test_a_draft_of_another_vocabulary_is_lossless(smollm2_path, gemma3_path, mode, topo, sampling):
    want = reference(str(smollm2_path), PROMPT, 24, sampling)
    got = generate(smollm2_path, "-p", PROMPT, "-n", 24, "--mode", mode, "--draft", gemma3_path, *topo, *sampling)
    assert tuple(got["tokens"]) == want
    assert got["draft_vocab"] == "translated"


@pytest.mark.parametrize("mode, topo, sampling", [
    ("pipeinfer", ("--ranks", 2), GREEDY),
    ("pipeinfer", ("--layer-split", "1/1"), SEEDED),
    ("speculative", ("--ranks", 1), GREEDY),
], ids=["pipeinfer-2-greedy", "pipeinfer-1/1-seeded", "speculative-1-greedy"])
def test_hybrid_drafting_is_lossless_and_reports_each_source(smollm2_path, gemma3_path, mode, topo, sampling):
    want = reference(str(smollm2_path), COPY, 40, sampling, "--chat")
    got = generate(smollm2_path, "--chat", COPY, "-n", 40, "--mode", mode, "--draft", f"lookup+{gemma3_path}", *topo,
                   *sampling)
    assert tuple(got["tokens"]) == want
    by_source = got["acceptance"]["by_source"]
    assert by_source["lookup"]["drafted"] > 0
    assert sum(s["drafted"] for s in by_source.values()) == got["acceptance"]["drafted"]
    if "1/1" not in topo:  # drafted synchronously: the model drafts where lookup has no match
        assert by_source["model"]["drafted"] > 0
    assert got["draft"] == f"lookup+{gemma3_path}"


@pytest.mark.slow  # pulls Qwen2.5-Coder-1.5B (1.1 GB): make test-slow
def test_smollm2_drafting_for_qwen_coder_15b(qwen15_path, smollm2_path):
    prompt = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""'
    want = reference(str(qwen15_path), prompt, 32, GREEDY)
    got = generate(qwen15_path, "-p", prompt, "-n", 32, "--mode", "pipeinfer", "--ranks", 2, "--draft", smollm2_path)
    assert tuple(got["tokens"]) == want
    assert got["draft_vocab"] == "translated" and got["acceptance"]["accepted"] > 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("xvocab")
    return {"target": write_tiny_model(d / "target.gguf", arch="qwen2", n_layer=4, seed=0),
            # Random weights and 512 tokens: a draft of another vocabulary that is nearly always wrong.
            "other": write_tiny_model(d / "vocab512.gguf", arch="qwen2", n_layer=4, seed=1, n_vocab=512),
            "spm": write_tiny_model(d / "spm.gguf", arch="qwen2", n_layer=2, seed=2, n_vocab=400, spm=True)}


def test_a_draft_that_is_always_wrong_still_gives_the_right_tokens(tiny):
    want = reference(str(tiny["target"]), PROMPT, 32, GREEDY)
    got = generate(tiny["target"], "-p", PROMPT, "-n", 32, "--threads", 1, "--mode", "pipeinfer", "--ranks", 2,
                   "--draft", tiny["other"], "--p-accept", 0)
    assert tuple(got["tokens"]) == want
    assert got["draft_vocab"] == "translated" and got["acceptance"]["drafted"] > got["acceptance"]["accepted"]


@pytest.mark.parametrize("topo", [("--ranks", 1), ("--layer-split", "1/1")], ids=["draft-on-head", "draft-rank"])
def test_a_draft_that_cannot_spell_text_back_is_refused(tiny, topo):
    r = subprocess.run([sys.executable, "-m", "pipeinfer_cli", "generate", str(tiny["target"]), "-p", "Hi", "-n", "4",
                        "--threads", "1", "--draft", str(tiny["spm"]), *map(str, topo)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "byte for byte" in lines[0], r.stderr
