"""How far ahead pipeinfer drafts (decode/draft_budget.py): the depth follows the measured acceptance
and the measured cost of a drafted token; with several runs in flight, fewer tokens are drafted per
committed one, and the tokens stay those of plain decoding."""

from __future__ import annotations

import pytest

from pipeinfer_cli.decode.draft_budget import MAX_DEPTH, DraftBudget
from test_pipeinfer_policy import FakePipeline, OracleDrafter, assert_clean, reference, run_policy


def test_depth_follows_the_measured_acceptance():
    b = DraftBudget(0.5)
    assert b.depth() == 6  # the prior: 0.9 per token, 0.9^6 >= 0.5 > 0.9^7
    for _ in range(40):
        b.observe(5, 4)  # 0.8 per token
    assert b.rate == pytest.approx(0.8, abs=0.02)
    assert b.depth() == 3  # 0.8^3 >= 0.5 > 0.8^4
    for _ in range(200):
        b.observe(1, 1)
    assert b.depth() > 12
    assert DraftBudget(0.0).depth() == MAX_DEPTH


def test_room_is_what_is_left_and_never_nothing_with_nothing_in_flight():
    b = DraftBudget(0.5)
    for _ in range(100):
        b.observe(2, 0)  # a draft that is always wrong
    assert b.depth() == 0
    assert b.room(0) == 1 and b.room(1) == 0  # one token at a time keeps measuring it
    ok = DraftBudget(0.5)
    assert ok.room(0) == 6 and ok.room(4) == 2 and ok.room(9) == 0


def test_cheap_rows_lower_the_bar():
    """Rows nearly free to verify and a cheap draft (a pipeline of fast stages): a drafted token is
    worth it at a lower chance of being reached; on a CPU, where a row costs about a one-token run,
    p_reach holds."""
    cheap, cpu = DraftBudget(0.5), DraftBudget(0.5)
    for b, row in ((cheap, 0.01e-3), (cpu, 0.9e-3)):
        for _ in range(50):
            b.observe(5, 4)
        b.head_run(1, 1e-3)
        b.head_run(5, 1e-3 + 4 * row)
        b.single_pass(4.2e-3)
        b.drafted(4, 4 * 0.1e-3)
    assert cheap.cost_share() == pytest.approx(0.1 / 4.2 + 0.01, rel=1e-6)
    assert cheap.bar() == cheap.cost_share() and cheap.depth() >= 10
    assert cpu.bar() == 0.5 and cpu.depth() == 3


def wrong_one_in(k: int):
    return lambda pos: hash((pos, 11)) % k == 0


@pytest.mark.parametrize("latency", [3, 6])
def test_fewer_tokens_are_drafted_per_committed_one(latency):
    """Several runs in flight, a draft right about 4 times in 5: drafting up to --max-inflight runs
    of --n-draft tokens drafts over 2 tokens per committed one (the runs past a rejection are
    drafted and verified for nothing); drafting only as far as the acceptance makes a token worth
    it, at most 1.5."""
    n = 200
    results = {}
    for p_reach in (0.0, 0.5):
        pipe = FakePipeline(latency=latency, n_seq_max=6)
        s, _ = run_policy(pipe, OracleDrafter(wrong_one_in(5), alternatives=False), n=n, p_reach=p_reach)
        assert s.tokens == reference(n)
        assert_clean(pipe, s)
        results[p_reach] = s.metrics
    unlimited, budgeted = results[0.0], results[0.5]
    assert budgeted.acceptance.rate >= 0.8
    assert budgeted.drafting.proposed / n <= 1.5 < unlimited.drafting.proposed / n
    assert budgeted.drafting.launched <= budgeted.drafting.proposed
    assert budgeted.runs.cancelled < unlimited.runs.cancelled
