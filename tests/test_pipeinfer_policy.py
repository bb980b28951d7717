"""The pipeinfer policy against a fake pipeline and fake drafters: no MPI, no model.

The fake pipeline keeps a KV cache of cells (position, token, sequences) as llama.cpp does, so a
wrong `seq_cp`/`seq_rm` shows: a row whose sequence lacks a position, or holds two cells for one,
fails. Its "target" computes a row's logits from the tokens the row attends to, so the greedy
token is a function of the prefix; results come back at launch (one stage) or some polls later
(several runs in flight).
"""

from __future__ import annotations


import numpy as np
import pytest

from pipeinfer_cli.decode.async_draft import AsyncDraft
from pipeinfer_cli.decode.pipeinfer import PipeInfer
from pipeinfer_cli.decode.sync import prefill
from pipeinfer_cli.decode.drafters import AsyncDrafter, Drafter, Proposal
from pipeinfer_cli.decode.kv_slots import KvSlots
from pipeinfer_cli.decode.virtual_pipeline import VirtualPipeline
from pipeinfer_cli.decode.sampling import SamplingParams, sample
from pipeinfer_cli.decode.session import DecodeOptions, Session
from pipeinfer_cli.decode.tree import (
    Branch,
    Walk,
    confident,
    shared_prefix,
    tree_batch,
    walk_tree,
)

V = 50  # vocabulary of the fake target
PROMPT = [1, 2, 3, 4, 5, 6, 7]
GREEDY = SamplingParams()
TEMP = SamplingParams(temperature=0.8, seed=7)


def target_logits(ctx: tuple[int, ...]) -> np.ndarray:
    """The fake target's logits after `ctx`: a pure function of the whole prefix."""
    return np.random.default_rng(abs(hash(ctx))).normal(size=V).astype(np.float32) * 3


def target_greedy(ctx) -> int:
    return int(np.argmax(target_logits(tuple(ctx))))


def reference(n: int, params: SamplingParams = GREEDY, prompt=PROMPT) -> list[int]:
    """Plain decoding of the fake target: one token at a time."""
    toks = list(prompt)
    while len(toks) < len(prompt) + n:
        toks.append(sample(target_logits(tuple(toks)), params, len(toks)))
    return toks


class FakePipeline(VirtualPipeline):
    """The package's virtual pipeline with the fake target above."""

    def __init__(self, latency: int = 0, n_seq_max: int = 10, n_ctx: int = 512):
        super().__init__(target_logits, latency, n_seq_max, n_ctx)


class OracleDrafter:
    """Proposes the fake target's greedy continuation, wrong at the positions `wrong(pos)` says
    (it then proposes another token, with the true one as runner-up). Alternatives make trees.
    p: its confidence, a number or a function of the position."""

    name = "oracle"

    def __init__(self, wrong=lambda pos: False, p=0.9, alt_p: float = 0.3, alternatives: bool = True):
        self.wrong, self.p, self.alt_p, self.alternatives = wrong, p, alt_p, alternatives
        self.calls: list[tuple[list[int], int]] = []

    def start(self, prompt):
        pass

    def close(self):
        pass

    def propose(self, path, n_max, p_min):
        self.calls.append((list(path), n_max))
        out = Proposal([], [], [])
        ctx = list(path)
        while len(out.tokens) < n_max:
            true = target_greedy(ctx)
            tok, runner_up = ((true + 1) % V, true) if self.wrong(len(ctx)) else (true, (true + 1) % V)
            out.tokens.append(tok)
            conf = self.p(len(ctx)) if callable(self.p) else self.p
            out.probs.append(conf)
            out.alternatives.append([(runner_up, self.alt_p)] if self.alternatives else [])
            if conf < p_min:
                break
            ctx.append(tok)
        return out


class AsyncOracle:
    """A draft rank's head-side interface: the oracle's proposals arrive `delay` polls after the request."""

    def __init__(self, oracle: OracleDrafter, delay: int):
        self.oracle, self.delay = oracle, delay
        self.requested = None
        self.countdown = 0
        self.requests: list[tuple[list[int], int]] = []

    @property
    def outstanding(self) -> bool:
        return self.requested is not None

    def request(self, path, n_max, p_min):
        assert self.requested is None, "one draft request at a time"
        self.requested, self.countdown = (list(path), n_max, p_min), self.delay
        self.requests.append((list(path), n_max))

    def ready(self) -> bool:
        self.countdown -= 1
        return self.countdown <= 0

    def poll(self, whole=False):
        if self.requested is None or not self.ready():
            return None
        (path, n, p_min), self.requested = self.requested, None
        prop = self.oracle.propose(path, n, p_min)
        prop.base = path
        return prop

    def wait(self, whole=False):
        self.countdown = 0
        return self.poll()

    def end_stream(self):
        self.requested = None


def run_policy(pipe: FakePipeline, drafter, n: int = 40, params: SamplingParams = GREEDY, **opts) -> tuple[Session, PipeInfer]:
    s = Session(list(PROMPT), params, n, lambda t: False)
    prefill(pipe, s)
    pipe.log.clear()

    def wait_until(cond):
        for _ in range(10_000):
            if cond():
                return
        raise AssertionError("waited forever")

    policy = PipeInfer(pipe, s, DecodeOptions(n_predict=n, **{"p_accept": 0.5, "n_draft": 4, "max_inflight": 4, **opts}),
                       drafter, wait_until=wait_until, clock=lambda: 0.0)
    policy.run()
    return s, policy


def assert_clean(pipe: FakePipeline, s: Session) -> None:
    """After a request only the canonical sequence remains, holding every committed token but the last."""
    assert pipe.kv_used_cells() == len(s.tokens) - 1
    assert pipe.context(0, len(s.tokens) - 2) == tuple(s.tokens[:-1])
    assert not pipe.ready and not pipe.pending


# -- tree layout -----------------------------------------------------------------------------------
def test_tree_batch_lays_out_a_split_run():
    b = tree_batch([[10, 11, 12, 13], [10, 11, 20, 21], [10, 11, 30]], [3, 4, 5], pos0=7)
    assert b.tokens == [10, 11, 12, 13, 20, 21, 30]
    assert b.pos == [7, 8, 9, 10, 9, 10, 9]
    assert b.seq_ids == [[3, 4, 5], [3, 4, 5], [3], [3], [4], [4], [5]]
    assert b.output == [True] * 7
    assert [br.rows for br in b.branches] == [[0, 1, 2, 3], [0, 1, 4, 5], [0, 1, 6]]
    assert [br.seq for br in b.branches] == [3, 4, 5]
    assert [br.tokens for br in b.branches] == [[10, 11, 12, 13], [10, 11, 20, 21], [10, 11, 30]]


def test_tree_batch_of_one_path_and_of_a_split_at_the_first_token():
    one = tree_batch([[5, 6, 7]], [2], pos0=0)
    assert (one.tokens, one.pos, one.seq_ids) == ([5, 6, 7], [0, 1, 2], [[2], [2], [2]])
    assert one.branches[0].rows == [0, 1, 2]
    split = tree_batch([[5, 6], [8]], [1, 2], pos0=4)
    assert (split.tokens, split.pos, split.seq_ids) == ([5, 6, 8], [4, 5, 4], [[1], [1], [2]])
    assert [br.rows for br in split.branches] == [[0, 1], [2]]
    assert shared_prefix([[1, 2, 3], [1, 2]]) == 2 and shared_prefix([[1], [2]]) == 0


def test_walk_tree_follows_the_branch_the_target_agrees_with():
    b = tree_batch([[10, 11, 12, 13], [10, 11, 20, 21], [10, 11, 30]], [3, 4, 5], pos0=0)
    # The target's sample after each row: it agrees with branch 1 to its end.
    after_row = {0: 11, 1: 20, 4: 21, 5: 99}
    walk = walk_tree(b.branches, lambda row, i: after_row[row])
    assert walk == Walk([11, 20, 21, 99], winner=1, matched_all=True)
    assert walk.acceptance(taken=4) == (3, 3)
    # It disagrees after branch 2's last token is matched by none: the first candidate still matching wins.
    after_row = {0: 11, 1: 20, 4: 7}
    walk = walk_tree(b.branches, lambda row, i: after_row[row])
    assert walk == Walk([11, 20, 7], winner=1, matched_all=False)
    assert walk.acceptance(taken=3) == (3, 2)
    assert walk.acceptance(taken=2) == (2, 2)  # an end of text cut the commit: the rejection is not counted
    # A dead branch is not followed, even if it matches.
    b.branches[1].alive = False
    after_row = {0: 11, 1: 30, 6: 5}
    walk = walk_tree(b.branches, lambda row, i: after_row[row])
    assert walk == Walk([11, 30, 5], winner=2, matched_all=True)


def test_walk_tree_sample_gets_the_input_index():
    br = [Branch(1, [4, 5, 6], [0, 1, 2])]
    seen = []
    walk_tree(br, lambda row, i: seen.append((row, i)) or [5, 6, 0][i])
    assert seen == [(0, 0), (1, 1), (2, 2)]
    assert confident([0.9, 0.6, 0.4, 0.9], 0.5) == 2 and confident([], 0.5) == 0


def test_kv_slots_hand_out_lowest_ids_and_issue_kv_ops():
    pipe = FakePipeline()
    slots = KvSlots(pipe, 4)
    assert slots.take(2) == [1, 2] and slots.n_free == 1
    assert slots.take(5) == [3] and slots.take(1) == []
    slots.inherit(0, [1, 2])
    slots.commit(2, 7, 9)
    slots.drop(2)
    assert slots.take(1) == [2]
    assert pipe.log == [("seq_cp", 0, [1, 2], -1, -1), ("seq_cp", 2, [0], 7, 9), ("seq_rm", 2, -1, -1)]


def test_drafter_protocols():
    from pipeinfer_cli.decode.lookup import LookupDrafter
    from pipeinfer_cli.runtime.remote_draft import RemoteDrafter

    assert isinstance(AsyncOracle(OracleDrafter(), 1), AsyncDrafter)
    assert isinstance(RemoteDrafter(None, 1), AsyncDrafter)
    assert not isinstance(OracleDrafter(), AsyncDrafter) and not isinstance(LookupDrafter(), AsyncDrafter)
    d: Drafter = OracleDrafter()
    assert d.name == "oracle"


# -- verification, commits, cancellation ----------------------------------------------------------
def test_one_stage_right_draft_commits_each_run_through_its_sequence():
    pipe = FakePipeline(latency=0)
    s, _ = run_policy(pipe, OracleDrafter(), n=10)
    want = reference(10)
    assert s.tokens == want
    assert pipe.log[:8] == [
        ("seq_cp", 0, [1], -1, -1),  # the frontier run inherits the committed prefix
        ("launch", 2, [want[7]], [7], [[1]], False),
        ("seq_cp", 1, [2], -1, -1),  # the speculative run continues the frontier run's sequence
        ("launch", 3, want[8:12], [8, 9, 10, 11], [[2]] * 4, True),
        ("seq_cp", 1, [0], 7, 8), ("seq_rm", 1, -1, -1),  # commit the frontier run, drop its sequence
        ("seq_cp", 2, [0], 8, 12), ("seq_rm", 2, -1, -1),  # all 4 drafted tokens accepted, plus one
    ]
    assert not pipe.ops("cancel")
    runs, acc = s.metrics.runs, s.metrics.acceptance
    assert (runs.launched, runs.speculative, runs.cancelled) == (1 + 4, 2, 0)  # the prefill counts one
    assert (acc.drafted, acc.accepted, acc.verified_runs) == (7, 7, 2)
    assert_clean(pipe, s)


def test_a_wrong_draft_token_cancels_the_runs_built_on_it():
    pipe = FakePipeline(latency=2)
    s, _ = run_policy(pipe, OracleDrafter(wrong=lambda pos: pos == 10), n=10, n_draft=2)
    want = reference(10)
    assert s.tokens == want
    launches = {op[0]: op for op in pipe.ops("launch")}
    assert launches[3][1] == want[8:10] and launches[4][1][0] == want[10] + 1  # run 4 starts wrong
    # Run 3's verification yields want[10], which run 4 does not start with: run 4 alone is cancelled,
    # its sequence dropped, and decoding goes on from the committed tokens.
    assert pipe.ops("cancel") == [([4],)]
    i = pipe.log.index(("cancel", [4]))
    assert pipe.log[i - 2:i + 4] == [("seq_cp", 2, [0], 8, 10), ("seq_rm", 2, -1, -1), ("cancel", [4]),
                                     ("seq_rm", 3, -1, -1), ("seq_cp", 0, [3], -1, -1),
                                     ("launch", 5, [want[10]], [10], [[3]], False)]
    runs, acc = s.metrics.runs, s.metrics.acceptance
    assert (runs.cancelled, runs.cancelled_at_end) == (1, 0)
    assert (acc.drafted, acc.accepted) == (7, 6)
    assert_clean(pipe, s)


def test_a_wrong_token_inside_a_run_cancels_every_later_run():
    pipe = FakePipeline(latency=4)
    s, policy = run_policy(pipe, OracleDrafter(wrong=lambda pos: pos == 9), n=12, n_draft=2, max_inflight=4)
    assert s.tokens == reference(12)
    first = pipe.ops("cancel")[0][0]
    spec = [op[0] for op in pipe.ops("launch") if op[4]]
    # The run holding the wrong token at position 9 (run 3, positions 8-9) is verified while runs 4
    # and 5 continue it: both are cancelled in one message.
    assert spec[:3] == [3, 4, 5] and first == [4, 5]
    assert policy.rejections >= 1 and s.metrics.runs.cancelled >= 2
    assert_clean(pipe, s)


def test_tree_branches_are_pruned_as_soon_as_the_previous_run_decides_them():
    pipe = FakePipeline(latency=2)
    s, _ = run_policy(pipe, OracleDrafter(wrong=lambda pos: pos == 10), n=8, n_draft=2, max_branches=2)
    want = reference(8)
    assert s.tokens == want
    launches = {op[0]: op for op in pipe.ops("launch")}
    # Run 4 splits at its first token: the draft's wrong token (seq 4) and the true runner-up (seq 5).
    toks, pos, seq_ids = launches[4][1:4]
    assert toks[0] == want[10] + 1 and toks[2:] == want[10:12]
    assert (pos, seq_ids) == ([10, 11, 10, 11], [[4], [4], [5], [5]])
    # Run 3's verification decides it: branch 0 dies at once (seq_rm 4) and the commit goes through seq 5.
    i = pipe.log.index(("seq_rm", 4, -1, -1))
    assert pipe.log[i - 2:i + 2] == [("seq_cp", 2, [0], 8, 10), ("seq_rm", 2, -1, -1), ("seq_rm", 4, -1, -1),
                                     ("seq_cp", 5, [0], 10, 12)]
    assert not pipe.ops("cancel")
    runs = s.metrics.runs
    assert (runs.branches_launched, runs.branches_cancelled) == (3, 3)
    assert_clean(pipe, s)


def test_a_pruned_followed_branch_cancels_the_runs_that_continue_it():
    pipe = FakePipeline(latency=4)
    s, _ = run_policy(pipe, OracleDrafter(wrong=lambda pos: pos == 10), n=12, n_draft=2, max_branches=2, max_inflight=4)
    assert s.tokens == reference(12)
    launches = pipe.ops("launch")
    assert [op[0] for op in launches[:4]] == [2, 3, 4, 5] and launches[2][2][0] == 10  # run 4 splits at position 10
    # Run 5 continues run 4's branch 0, which dies when run 3 is verified: run 5 is cancelled, not run 4.
    assert pipe.ops("cancel")[0] == ([5],)
    assert s.metrics.runs.branches_cancelled >= 1
    assert_clean(pipe, s)


def test_no_speculation_below_the_confidence_threshold():
    pipe = FakePipeline(latency=2)
    s, _ = run_policy(pipe, OracleDrafter(p=0.4), n=6)
    assert s.tokens == reference(6)
    runs = s.metrics.runs
    assert (runs.launched, runs.speculative, runs.cancelled) == (1 + 5, 0, 0)  # one run per token after the first
    assert s.metrics.acceptance.drafted == 0
    assert_clean(pipe, s)


def test_an_end_of_text_inside_a_run_counts_only_committed_comparisons():
    want = reference(20)
    eog = want[len(PROMPT) + 5]
    pipe = FakePipeline(latency=0)
    s = Session(list(PROMPT), GREEDY, 20, lambda t: t == eog)
    prefill(pipe, s)
    PipeInfer(pipe, s, DecodeOptions(n_predict=20, n_draft=4, spec_policy="always"), OracleDrafter(),
              wait_until=lambda c: None).run()
    assert s.tokens == want[:want.index(eog, len(PROMPT)) + 1] and s.finish_reason == "stop"
    acc = s.metrics.acceptance
    assert acc.drafted == acc.accepted == s.n_gen - 1 - 1  # the frontier run's token and the end are not drafted
    assert_clean(pipe, s)


# -- asynchronous drafting --------------------------------------------------------------------------
def test_async_replies_are_launched_when_consistent_and_dropped_when_stale():
    oracle = OracleDrafter(wrong=lambda pos: pos % 7 == 3)
    drafter = AsyncOracle(oracle, delay=2)
    pipe = FakePipeline(latency=3)
    verdicts = []
    take = AsyncDraft.take
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AsyncDraft, "take", lambda self, *a: verdicts.append(take(self, *a)) or verdicts[-1])
        s, policy = run_policy(pipe, drafter, n=30)
    assert s.tokens == reference(30)
    assert [] in verdicts and any(verdicts)  # some replies were stale (dropped), some launched
    acc = s.metrics.acceptance
    assert s.metrics.runs.speculative > 0 and 0 < acc.accepted < acc.drafted
    assert not drafter.outstanding and policy.draft.reply is None  # drained
    # Every request continues the path of its moment with no confidence cutoff; no two in a row for one path.
    assert all(p_n[1] > 0 for p_n in drafter.requests)
    assert all(a != b for a, b in zip(drafter.requests, drafter.requests[1:]))
    assert_clean(pipe, s)


def test_an_unconfident_reply_is_kept_and_not_asked_again():
    drafter = AsyncOracle(OracleDrafter(p=0.4), delay=1)
    pipe = FakePipeline(latency=2)
    s, _ = run_policy(pipe, drafter, n=8)
    assert s.tokens == reference(8)
    assert s.metrics.runs.speculative == 0
    paths = [tuple(p) for p, _ in drafter.requests]
    assert len(paths) == len(set(paths))  # a refused path is not asked for again
    assert_clean(pipe, s)


# -- the whole policy: lossless against plain decoding ---------------------------------------------
@pytest.mark.parametrize("latency", [0, 1, 3])
@pytest.mark.parametrize("params", [GREEDY, TEMP], ids=["greedy", "temp"])
@pytest.mark.parametrize("drafter", ["right", "wrong", "tree", "async", "async-tree-slow"])
def test_tokens_equal_plain_decoding(latency, params, drafter):
    wrong = lambda pos: hash((pos, 5)) % 3 == 0
    opts = {}
    if drafter == "right":
        d = OracleDrafter()
    elif drafter == "wrong":
        d = OracleDrafter(wrong, alternatives=False)
    elif drafter == "tree":
        d, opts = OracleDrafter(wrong, p=lambda pos: [0.95, 0.8, 0.55, 0.3][pos % 4]), {"max_branches": 3, "p_split": 0.1}
    elif drafter == "async":
        d = AsyncOracle(OracleDrafter(wrong), delay=2)
    else:
        d, opts = AsyncOracle(OracleDrafter(wrong), delay=7), {"max_branches": 2, "p_accept": 0.0}
    pipe = FakePipeline(latency=latency, n_seq_max=6)
    s, _ = run_policy(pipe, d, n=40, params=params, **opts)
    assert s.tokens == reference(40, params)
    m = s.metrics
    assert m.runs.launched > 0 and m.acceptance.accepted <= m.acceptance.drafted
    if drafter == "right" and params is GREEDY:
        assert m.acceptance.accepted == m.acceptance.drafted > 0 and m.runs.cancelled == m.runs.cancelled_at_end
    assert_clean(pipe, s)


def test_the_draft_prefill_thread_leaves_the_cpu_to_the_stages():
    """The draft's prompt pass runs in a thread at a higher nice value (Linux: per thread), so that
    on a host with no idle core it does not delay the target's prefill; the head's own thread keeps
    its priority."""
    import os
    import threading

    from pipeinfer_cli.decode.sync import DRAFT_PREFILL_NICE, _Background

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    main = nice()
    seen: list[int] = []
    _Background(lambda: seen.append(nice())).join()
    assert seen == [min(19, main + DRAFT_PREFILL_NICE)]
    assert nice() == main
