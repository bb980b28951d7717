"""A short soak (scripts/soak.py; `make soak` runs 1,000 requests): one 3-rank job serves SOAK_REQUESTS
requests in a row, in all three modes, with model and lookup drafts, token trees and random
lengths, and nothing leaks or drifts: KV cells back to zero before every request, resident memory within 5 % after warm-up, no file descriptor or
thread more, and the control prompt's tokens never change."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parents[1]
SOAK_REQUESTS = 100  # about 2 minutes on a quiet 2-core machine (1,000 took 17 minutes)


def test_short_soak(smollm2_path, tmp_path):
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--requests", str(SOAK_REQUESTS),
                        "--model", str(smollm2_path), "--json", str(out)], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    fig = data["figures"]
    assert data["problems"] == [] and fig["requests"] == SOAK_REQUESTS
    # The job really exercised what it checks: every mode, cancelled runs, tree branches, controls.
    assert all(n > 0 for n in fig["modes"].values())
    assert fig["runs_cancelled"] > 0 and fig["tree_branches"] > 0
    assert fig["control_runs"] >= 5 and fig["control_variants"] == 1
    assert sorted(fig["ranks"]) == ["0", "1", "2"]
