"""Token trees as pure data: the batch layout of a run, and the walk that verifies it.

A run carries one path, or a narrow tree of paths (branches) that share a prefix and split once.
`tree_batch` lays the branches out as one batch: the shared prefix once, one row per token,
belonging to every branch's KV sequence; then each branch's own tokens, in its sequence only.
`walk_tree` follows the branch whose tokens equal the target's samples. A `Flight` is a run in
flight as the head sees it. Nothing here touches the pipeline, the KV cache or a clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Branch:
    """One path of a run (a plain run has exactly one)."""

    seq: int  # KV sequence the branch writes into
    tokens: list[int]  # its input tokens at positions pos0, pos0+1, … (the shared prefix included)
    rows: list[int]  # batch row (= logits row) of each of those tokens
    alive: bool = True


@dataclass
class Flight:
    """A run in flight, as the head sees it."""

    run_id: int
    pos0: int  # position of its first input token
    branches: list[Branch]
    speculative: bool
    parent: tuple[int, int] | None = None  # (run_id, branch) it continues; None = the canonical sequence
    follow: int = 0  # the branch later runs continue
    cancelled: bool = False
    n_cells: int = 0  # rows of its batch (KV cells it takes on each stage)
    source: str | None = None  # the hybrid drafter's source of its drafted tokens (Proposal.source)
    t_launch: float = 0.0  # the head's clock when it was launched

    @property
    def tokens(self) -> list[int]:
        return self.branches[self.follow].tokens

    @property
    def seq(self) -> int:
        return self.branches[self.follow].seq

    @property
    def end(self) -> int:
        """Position just after the last input token of the followed branch."""
        return self.pos0 + len(self.tokens)

    def alive(self) -> list[Branch]:
        return [b for b in self.branches if b.alive]


@dataclass
class TreeBatch:
    """What `Pipeline.launch` takes, and the branches the rows belong to."""

    tokens: list[int]
    pos: list[int]
    seq_ids: list[list[int]]
    output: list[bool]
    branches: list[Branch]


def shared_prefix(paths: list[list[int]]) -> int:
    """Length of the prefix common to every path."""
    first = paths[0]
    n = 0
    while n < len(first) and all(len(p) > n and p[n] == first[n] for p in paths):
        n += 1
    return n


def tree_batch(branch_tokens: list[list[int]], seqs: list[int], pos0: int) -> TreeBatch:
    """Lay out a run whose branch b has inputs branch_tokens[b] from position pos0, in sequence seqs[b].

    The shared prefix comes first, one row per token with every branch's sequence; then each
    branch's remaining tokens, in branch order. Every row outputs logits (it is verified).
    """
    assert len(branch_tokens) == len(seqs) > 0
    shared = shared_prefix(branch_tokens)
    toks = list(branch_tokens[0][:shared])
    pos = list(range(pos0, pos0 + shared))
    sids = [list(seqs) for _ in range(shared)]
    branches = []
    for bt, seq in zip(branch_tokens, seqs):
        rows = list(range(shared))
        for i in range(shared, len(bt)):
            rows.append(len(toks))
            toks.append(bt[i])
            pos.append(pos0 + i)
            sids.append([seq])
        branches.append(Branch(seq, list(bt), rows))
    return TreeBatch(toks, pos, sids, [True] * len(toks), branches)


@dataclass
class Walk:
    """The outcome of verifying a run."""

    tokens: list[int]  # the target's samples: one per input followed, the last one beyond the match
    winner: int  # index (among all branches) of the branch the commit goes through
    matched_all: bool  # the winner's every input after the first equals the target's sample

    def acceptance(self, taken: int) -> tuple[int, int]:
        """(drafted, accepted) comparisons of this run, counting only rows whose token was committed
        (`taken` of `tokens`: none past an end of text)."""
        compared = len(self.tokens) - 1 if self.matched_all else len(self.tokens)
        counted = min(compared, taken)
        return counted, counted - (0 if self.matched_all or counted < compared else 1)


def walk_tree(branches: list[Branch], sample: Callable[[int, int], int]) -> Walk:
    """Follow, from the run's first input, the live branches whose next input equals the target's sample.

    sample(row, i): the target's token after input i, from logits row `row`. Row i of a branch
    predicts its input i+1; the walk stops at the first sample no live branch continues with.
    The winner is the first branch matched to its very end, else the first still matching.
    """
    cand = [k for k, b in enumerate(branches) if b.alive]
    new: list[int] = []
    i = 0
    while True:
        t = sample(branches[cand[0]].rows[i], i)
        new.append(t)
        nxt = [k for k in cand if len(branches[k].tokens) > i + 1 and branches[k].tokens[i + 1] == t]
        if not nxt:
            break
        cand, i = nxt, i + 1
    ended = [k for k in cand if len(branches[k].tokens) == i + 1]  # branches matched to their very end
    return Walk(new, (ended or cand)[0], bool(ended))


def confident(probs: list[float], threshold: float) -> int:
    """Length of the leading run of probabilities >= threshold (the part of a draft worth launching)."""
    keep = 0
    while keep < len(probs) and probs[keep] >= threshold:
        keep += 1
    return keep
