"""Calibration that knows its noise (runtime/calibrate_noise.py), driven by made-up timings:

- a point's spread is how far its median sits above its best repeat;
- quiet repeats stop after the minimum; noisy ones are repeated until they settle, or up to the
  bound, and then reported as unreliable;
- ranks of one machine identity whose figures disagree are named in one line, with their figures;
- a profile keeps the spreads and the warnings, and a profile without them (older) still reads.
"""

from __future__ import annotations

import itertools
import json

import pytest

from pipeinfer_cli.planner.profile import CostGrid, ModelFacts, Profile, RankCosts
from pipeinfer_cli.runtime.calibrate_noise import (NoiseLog, repeat_until_settled, spread, twin_disagreements,
                                                   unreliable_line)


def test_spread_is_the_median_above_the_best():
    assert spread([1.0, 1.0, 1.0]) == 0.0
    assert spread([1.0, 1.2, 1.1]) == pytest.approx(0.1)
    assert spread([2.0, 1.0, 4.0, 1.5]) == pytest.approx(0.75)  # median 1.75 over the best 1.0
    assert spread([3.0]) == 0.0 and spread([]) == 0.0


def _timer(values):
    """once(point) returning the next made-up timing of that point."""
    streams = {p: iter(v) for p, v in values.items()}
    calls = []

    def once(p):
        calls.append(p)
        return next(streams[p])
    return once, calls


def test_quiet_repeats_stop_at_the_minimum():
    once, calls = _timer({"a": itertools.repeat(1.0), "b": itertools.cycle([2.0, 2.04])})
    t = repeat_until_settled(["a", "b"], once, reps=3, warmup=1, max_reps=21)
    assert t.rounds == 3 and len(calls) == 2 * (1 + 3)  # interleaved: a, b, a, b, ...
    assert calls[:4] == ["a", "b", "a", "b"]
    assert t.medians == [1.0, 2.04] and t.worst <= 0.1  # warm-up took the first 2.0


def test_noisy_repeats_continue_until_they_settle():
    # Warm-up, then a busy spell (slow) that ends: the fast repeats soon outnumber the slow ones.
    seq = [9.0] + [3.0, 3.0, 1.0] + [1.0] * 20
    once, _ = _timer({"x": iter(seq)})
    t = repeat_until_settled(["x"], once, reps=3, warmup=1, max_reps=21)
    assert 3 < t.rounds < 21
    assert t.spreads[0] <= 0.1 and t.medians[0] == 1.0


def test_repeats_that_never_settle_stop_at_the_bound_and_say_so():
    once, calls = _timer({"x": itertools.cycle([1.0, 3.0])})
    t = repeat_until_settled(["x"], once, reps=3, warmup=1, max_reps=6)
    assert t.rounds == 6 and len(calls) == 7 and t.worst > 0.1
    log = NoiseLog()
    log.add("decode", t)
    log.add("prefill", repeat_until_settled(["y"], lambda _p: 1.0, 2, 0, 4))
    assert log.unsettled() == {"decode": pytest.approx(1.0)}
    line = unreliable_line(1, log.worst)
    assert line.startswith("rank 1: figures stayed unreliable") and "decode 100 %" in line and "prefill" not in line
    assert unreliable_line(0, {"decode": 0.05}) is None and unreliable_line(0, None) is None


def test_without_a_bound_the_minimum_is_all():
    once, calls = _timer({"x": itertools.cycle([1.0, 5.0])})
    assert repeat_until_settled(["x"], once, reps=4, warmup=0).rounds == 4 and len(calls) == 4


def _rank(rank, one_row_ms, cpu="CPU A", usable=2.0, threads=1, host=None):
    grid = CostGrid([1, 2], [16], [[one_row_ms * 1e-3, one_row_ms * 2e-3]])
    return RankCosts(rank, host or f"h{rank}", cpu, 2, threads, 8 << 30, 4 << 30, grid,
                     CostGrid([16], [0], [[1e-3]]), 1e-4, 1e-4, [0, 1], usable, 2, None, 1, spread={"decode": 0.02})


def test_twins_that_disagree_are_named_with_their_figures():
    ranks = [_rank(0, 0.565), _rank(1, 2.161), _rank(2, 0.6, cpu="CPU B"), _rank(3, 5.0, threads=2)]
    (line,) = twin_disagreements(ranks)
    assert line.startswith("ranks 0, 1 run on the same hardware (CPU A, 2 usable CPUs, 1 thread)")
    assert "0.565, 2.161 ms per layer (1 row, KV 16)" in line and "282% apart" in line
    assert twin_disagreements([_rank(0, 1.0), _rank(1, 1.2)]) == []  # within the margin
    assert twin_disagreements([_rank(0, 1.0), _rank(1, 1.2)], margin=0.1) != []


def test_a_profile_keeps_spreads_and_warnings_and_an_older_one_still_reads(tmp_path):
    model = ModelFacts("m", 100, "llama", 2, 8, 10, [10, 10], 5, "ab" * 32, 4)
    p = Profile(model, [_rank(0, 1.0)], [], warnings=["rank 0: figures stayed unreliable"])
    p.save(tmp_path / "p.json")
    back = Profile.load(tmp_path / "p.json")
    assert back.ranks[0].spread == {"decode": 0.02} and back.warnings == p.warnings
    old = json.loads((tmp_path / "p.json").read_text())
    del old["warnings"]
    del old["ranks"][0]["spread"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    older = Profile.load(tmp_path / "old.json")
    assert older.ranks[0].spread is None and older.warnings == []
