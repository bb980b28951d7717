"""The side branches of a token tree: where a draft splits, and how each branch continues.

A narrow, deep tree (pipeinfer's `--max-branches B > 1`): a draft splits once, at the first kept
position whose runner-ups beat p_split; each side branch takes one of those runner-ups and
continues by greedy drafting from it (a drafter can continue any path). Drafters without
alternatives (lookup) never split. How the branches are laid out in a batch and verified: `tree.py`.
"""

from __future__ import annotations

from .drafters import Drafter, Proposal
from .metrics import DraftWork
from .tree import confident


def side_branches(drafter: Drafter, path: list[int], prop: Proposal, keep: int, n_max: int, threshold: float,
                  p_split: float, budget: int, work: DraftWork) -> list[list[int]]:
    """Up to `budget` side branches of the draft `prop` continuing `path` (its first `keep` tokens
    kept), each at most n_max tokens from the path, continued while the drafter's confidence is at
    least `threshold`. The tokens they propose are counted in `work`."""
    for j in range(keep):
        alts = [t for t, p in prop.alternatives[j] if p > p_split][:budget] if j < len(prop.alternatives) else []
        if alts:
            break
    else:
        return []
    out = []
    for a in alts:
        stem = prop.tokens[:j] + [a]
        cont = drafter.propose(path + stem, n_max - len(stem), threshold) if n_max > len(stem) else None
        work.proposed += 1 + (len(cont.tokens) if cont else 0)  # the runner-up and its continuation
        out.append(stem + (cont.tokens[:confident(cont.probs, threshold)] if cont else []))
    return out
