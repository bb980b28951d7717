"""The lean wire: the last stage samples, so the head receives token ids, never logits.

The sampler is a pure function of (logits, seed, position); the same tokens come out in every mode
and on any number of ranks (the lossless tests), and here the bytes the head receives are O(rows),
not O(vocabulary): SmolLM2's logits would be 196,608 bytes a row.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from pipeinfer_cli.decode.sampling import SamplingParams, from_spec, sample, sample_rows, to_spec
from pipeinfer_cli.transport.messages import SamplingSpec


def test_sampling_spec_round_trips_bit_for_bit():
    p = SamplingParams(temperature=0.1 + 0.2, top_k=17, top_p=0.9000000000000001, min_p=1e-7, seed=2**62 + 5)
    assert from_spec(SamplingSpec.decode(to_spec(p).encode())) == p


def test_sample_rows_is_the_sampler_at_each_rows_position():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 300)).astype(np.float32)
    params = SamplingParams(temperature=0.8, seed=7)
    positions = np.array([10, 11, 12, 12, 40])
    got = sample_rows(logits, params, positions)
    assert got.dtype == np.int64
    assert list(got) == [sample(row, params, int(p)) for row, p in zip(logits, positions)]
    assert sample_rows(np.empty((0, 300), np.float32), params, []).shape == (0,)


@pytest.mark.mpi
@pytest.mark.parametrize("mode, ranks", [("iterative", 2), ("speculative", 3), ("pipeinfer", 2)])
def test_head_receives_a_few_bytes_per_row(smollm2_path, mode, ranks):
    cmd = [sys.executable, "-m", "pipeinfer_cli", "generate", str(smollm2_path), "-p", "def fib(n):", "-n", "24",
           "--draft", str(smollm2_path), "-M", mode, "--ranks", str(ranks), "--threads", "1", "--json",
           "--temp", "0.8", "--seed", "7"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    wire = json.loads(r.stdout)["wire"]
    assert wire["head_received_bytes_per_row"] < 64
    back = [x for x in wire["links"] if x["to"] == 0]
    assert len(back) == 1 and back[0]["from"] == ranks - 1


def test_handoff_gaps_come_from_the_trace_on_the_heads_clock():
    from pipeinfer_cli.decode.metrics import ProcessStats
    from pipeinfer_cli.decode.result import RankReport
    from pipeinfer_cli.runtime.handoff import handoff_ms

    def report(rank, offset, trace):
        return RankReport(rank, "stage", None, 1, 0.0, 0.0, 0.0, 0, "spin", ProcessStats(), trace=trace, clock_offset_s=offset)

    ranks = [
        report(0, 0.0, [("X", "stage", 1.000, 1.010, {"run": 1}), ("X", "stage", 1.020, 1.030, {"run": 2})]),
        # rank 1's clock runs 5 s ahead of the head's
        report(1, 5.0, [("X", "stage", 6.012, 6.020, {"run": 1}), ("i", "skip", 6.034, 6.034, {"run": 2}),
                        ("X", "draft", 6.0, 6.1, {})]),
    ]
    got = handoff_ms(ranks, 2)["0->1"]
    assert got["runs"] == 2 and got["max"] == pytest.approx(4.0) and got["p50"] == pytest.approx(3.0)
