"""A request resumed from the tokens it had committed (what `serve` does after a lost node) gives the
very tokens and text of the uninterrupted request, in every mode, greedy and seeded, and shows only
what the client has not seen yet."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeinfer_cli.transport.launch import find_mpiexec

JOB = Path(__file__).with_name("resume_job.py")


def run_job(ranks: int, spec: dict) -> list[dict]:
    cmd = [find_mpiexec(), "-n", str(ranks), sys.executable, str(JOB), json.dumps(spec)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


@pytest.mark.mpi
@pytest.mark.parametrize("mode, ranks, draft, temp, stop", [
    ("iterative", 1, None, 0.0, []),
    ("iterative", 2, None, 0.8, []),
    ("speculative", 2, "lookup", 0.0, ["13,"]),
    ("pipeinfer", 2, "lookup", 0.8, []),
    ("pipeinfer", 3, "self", 0.0, ["11"]),
])
def test_resumed_request_continues_exactly(smollm2_path, mode, ranks, draft, temp, stop):
    spec = {"model": str(smollm2_path), "draft": str(smollm2_path) if draft == "self" else draft, "mode": mode,
            "n": 48, "prompt": "Count on: 1, 2, 3, 4,", "temp": temp, "seed": 11, "stop": stop,
            "cuts": [1, 2, 9, 33, 47]}
    runs = run_job(ranks, spec)
    first, resumed = runs[0], runs[1:]
    assert first["shown"] == first["text"] and len(first["tokens"]) > 9
    assert len(resumed) >= 3
    for r in resumed:
        assert r["tokens"] == first["tokens"], r["cut"]
        assert r["text"] == first["text"], r["cut"]
        assert r["finish"] == first["finish"], r["cut"]
        # The resumed run shows exactly what the first had not shown after `cut` tokens: no gap, no repeat.
        assert r["shown"] == first["text"][first["shown_before"][r["cut"]]:], r["cut"]
