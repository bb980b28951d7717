"""benchmarks/native.py: the rows of a timed batch (no model needed)."""

from __future__ import annotations

import subprocess
import sys

import benchmarks.native as native


def test_a_batch_longer_than_the_prompt_has_all_its_rows():
    prompt = list(range(64))
    for b in (1, 8, 64, 65, 128, 200):
        batch = native.batch_tokens(prompt, b)
        assert len(batch) == b
        assert batch[:min(b, 64)] == prompt[:min(b, 64)]


def test_batches_that_do_not_fit_the_context_are_refused():
    out = subprocess.run([sys.executable, "-m", "benchmarks.native", "--batch-sizes", "8,1000", "--n-ctx", "1024"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith("Error: a batch of 1000 after the prompt needs --n-ctx of at least 1064")

