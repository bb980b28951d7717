"""Prompt-lookup drafting: continue the path with what followed the same tokens earlier in it.

The path is the prompt, the generated text and the tokens in flight, so the drafter copies from
the generated text as well as from the prompt. At every step it looks for the *longest* suffix
of the path that occurred before (up to `MATCH_CAP` tokens, falling back to shorter matches down
to one token), and proposes the tokens that followed it.

Its confidence comes from match statistics, not a fixed prior:

- the match length m: the longer the earlier match, the likelier the token after it is the
  target's next one (`HIT_RATE`, from the greedy answers to the grounded benchmark prompts:
  BENCHMARKS.md, "The lookup drafter, change by change");
- agreement: when several earlier occurrences match equally well, the share of them that continue
  with the proposed token (where they disagree, the proposal is rarely right), while
  several that agree make it likelier (1 - (1 - hit)^votes);
- position: the k-th token of a copy is accepted only if the k-1 before it were, and the match
  grows by one with each, so its confidence is the product of HIT_RATE(m), HIT_RATE(m+1), …
  (`Proposal.probs` are these cumulative probabilities: what a run of that length stands to gain).

So pipeinfer (`p >= --p-accept + p_adjust`) launches long copies from long matches and short or
no runs from weak ones, instead of cancelling runs that were never likely to hold. Tokens that
other earlier occurrences continue with are the runner-ups of the first position
(`Proposal.alternatives`), so `--max-branches` can verify two copies at once where the text was
ambiguous. It costs no model, so it does not compete with the target stages for the cores.
"""

from __future__ import annotations

import numpy as np

from .drafters import Proposal

MATCH_CAP = 32  # longest suffix matched; from 8 tokens on the hit rate no longer grows
# P(the token after the longest earlier match is the target's next one | match length m), m = 1..8+.
HIT_RATE = (0.0, 0.2, 0.45, 0.65, 0.85, 0.9, 0.9, 0.93, 0.97)


def hit_rate(m: int) -> float:
    return HIT_RATE[min(m, len(HIT_RATE) - 1)]


def suffix_matches(path: list[int] | np.ndarray, cap: int = MATCH_CAP) -> list[tuple[int, int]]:
    """(match length, end index j) of every earlier occurrence of the path's last token that has a
    successor: path[j-m+1 .. j] == path[-m:], longest m up to cap. Most recent first."""
    arr = np.asarray(path)
    n = len(arr)
    if n < 2:
        return []
    ends = np.flatnonzero(arr[:n - 1] == arr[n - 1])[::-1]
    out = []
    for j in ends.tolist():
        m = 1
        while m < cap and j - m >= 0 and arr[j - m] == arr[n - 1 - m]:
            m += 1
        out.append((m, j))
    return out


def vote(path: list[int], matches: list[tuple[int, int]]) -> list[tuple[int, float, int]]:
    """The candidate next tokens with their first-token confidence and their source, best first.

    Occurrences as long as the best one (all matches of 8+ tokens count as equally long) vote with
    the token that followed them; each token's confidence is the hit rate of its longest match,
    made likelier by agreeing votes and scaled by its share of the votes squared. The source is
    the end index of its longest, most recent match, where its continuation is copied from.
    """
    best_m = max(m for m, _ in matches)
    tie = min(best_m, len(HIT_RATE) - 1)
    top = [(m, j) for m, j in matches if min(m, tie) == tie]
    votes: dict[int, list[tuple[int, int]]] = {}
    for m, j in top:  # most recent first, so each token's first source is its most recent one
        votes.setdefault(path[j + 1], []).append((m, j))
    out = []
    for tok, srcs in votes.items():
        m, j = max(srcs, key=lambda s: s[0])  # longest; max keeps the first (most recent) on ties
        share = len(srcs) / len(top)
        p = (1.0 - (1.0 - hit_rate(m)) ** len(srcs)) * share * share
        out.append((tok, p, j))
    out.sort(key=lambda c: -c[1])  # stable: equal confidence keeps the most recent first
    return out


class LookupDrafter:
    """Prompt-lookup drafting with the longest match, confidence from match statistics, runner-ups."""

    name = "lookup"
    has_prompt_pass = False  # stateless: nothing to read before drafting

    def __init__(self, match_cap: int = MATCH_CAP, n_alternatives: int = 3):
        self.match_cap, self.n_alternatives = match_cap, n_alternatives

    @property
    def kv_tokens(self) -> list[int]:
        return []  # no KV cache of its own

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        out = Proposal([], [], [])
        if n_max <= 0:
            return out
        matches = suffix_matches(path, self.match_cap)
        if not matches:
            return out
        cands = vote(path, matches)
        tok, p, src = cands[0]
        m = max(mm for mm, j in matches if j == src)
        conf = p
        for k in range(n_max):
            at = src + 1 + k
            if at >= len(path) or (out.tokens and conf < p_min):
                break
            out.tokens.append(int(path[at]))
            out.probs.append(conf)
            out.alternatives.append([(int(t), q) for t, q, _ in cands[1:1 + self.n_alternatives]] if k == 0 else [])
            conf *= hit_rate(m + k + 1)  # the next token, once this one matched: a match one longer
        return out

    def start(self, prompt: list[int], reuse: int = 0) -> None:  # stateless: nothing to keep or clear
        pass

    def close(self) -> None:
        pass
