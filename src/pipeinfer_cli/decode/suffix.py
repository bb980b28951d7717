"""Suffix drafting (`--draft suffix`), after SuffixDecoding: continue the path with what followed
its longest earlier match, in the request's own tokens and in the job's earlier requests.

Two suffix automata (`suffix_automaton.py`), as SuffixDecoding keeps two suffix trees:

- the request's own: its prompt, the tokens generated so far and those in flight, appended as the
  path grows and taken back when speculation rolls back; the longest suffix of the path that
  occurred earlier in it is the state the path's end links to;
- the job's (`suffix_corpus.py`): earlier requests' prompts and answers (chat turns, serve
  requests, bench prompts), bounded by a token cap, the oldest dropped; the head adds each finished
  request to it (`SuffixCorpus.add`). The path's last `MATCH_WINDOW` tokens are matched in it.

From each match the drafter walks down the automaton, taking at every step the token that most
often followed (the most recent on ties). Its confidence comes from the match's frequency
statistics: with c of the n occurrences of the context followed by the token, and h the hit rate
of a match as long as that context (`lookup.HIT_RATE`: the longer, the likelier it holds),

    q = c/n * (1 - (1 - h)^c)

(the share of the occurrences that agree, made likelier by each agreeing one), and
`Proposal.probs` are the cumulative products, as lookup's are, so `--p-min`, pipeinfer's
threshold and `--max-branches` (runner-ups per position are the other tokens that followed, with
their q) apply unchanged. The draft is at most `SPEC_FACTOR` times the match length long
(SuffixDecoding's adaptive length: a short match drafts little, a long one a long run). Of the
two proposals the one with the larger sum of probabilities (expected accepted tokens) wins.
It costs no model; reading the prompt is one pass of appends (`start`).
"""

from __future__ import annotations

import heapq
import math

from .drafters import Proposal
from .lookup import hit_rate
from .suffix_automaton import SuffixAutomaton
from .suffix_corpus import SuffixCorpus

MATCH_WINDOW = 64  # tokens of the path matched against earlier requests (SuffixDecoding's tree depth)
SPEC_FACTOR = 1.0  # a draft is at most this many times as long as its match (SuffixDecoding's alpha)
N_ALTERNATIVES = 3


def confidence(count: int, total: int, context: int) -> float:
    """q of a token that followed `count` of the `total` occurrences of a `context`-token match."""
    return count / total * (1.0 - (1.0 - hit_rate(context)) ** count)


def continuation(sam: SuffixAutomaton, state: int, match: int, n_max: int, p_min: float,
                 n_alternatives: int = N_ALTERNATIVES) -> Proposal:
    """The most frequent continuation of the strings of `state` (matched over `match` tokens):
    up to min(n_max, SPEC_FACTOR * match) tokens, stopping under p_min after the first."""
    out = Proposal([], [], [])
    limit = min(n_max, max(1, math.ceil(SPEC_FACTOR * match)))
    cum, context = 1.0, match
    while len(out.tokens) < limit:
        kids, total = sam.children(state)
        if not kids:
            break
        kids = heapq.nlargest(1 + n_alternatives, kids, key=_rank)  # most frequent, then most recent
        tok, count, nxt, _ = kids[0]
        p = cum * confidence(count, total, context)
        if out.tokens and p < p_min:
            break
        out.tokens.append(tok)
        out.probs.append(p)
        out.alternatives.append([(t, confidence(c, total, context)) for t, c, _, _ in kids[1:1 + n_alternatives]])
        cum, state, context = p, nxt, context + 1
    return out


def _rank(kid: tuple[int, int, int, int]) -> tuple[int, int]:
    return kid[1], kid[3]


def _score(prop: Proposal) -> float:
    return sum(prop.probs)


class SuffixDrafter:
    """The request's own suffix automaton plus the job's corpus of earlier requests (shared by
    every request of the job; None: the request's own tokens only)."""

    name = "suffix"
    has_prompt_pass = False  # reading the prompt is appends, no model

    def __init__(self, corpus: SuffixCorpus | None = None, n_alternatives: int = N_ALTERNATIVES):
        self.corpus, self.n_alternatives = corpus, n_alternatives
        self.own = SuffixAutomaton(undo=True)
        self.text: list[int] = []  # the tokens `own` holds

    @property
    def kv_tokens(self) -> list[int]:
        return []  # no KV cache of its own

    def start(self, prompt: list[int], reuse: int = 0) -> None:
        """Begin a request: the request's automaton holds its prompt (the job's corpus is kept)."""
        self.own = SuffixAutomaton(undo=True)
        self.text = []
        self._sync(prompt)

    def _sync(self, path: list[int]) -> None:
        """Make the request's automaton hold `path`: take back what differs, append the rest."""
        text = self.text
        k = min(len(text), len(path))
        if text[:k] != path[:k]:
            lo, hi = 0, k  # text[:lo] == path[:lo], text[:hi] != path[:hi]
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if text[:mid] == path[:mid]:
                    lo = mid
                else:
                    hi = mid
            k = lo
        if k < len(text):
            self.own.truncate(k)
            del text[k:]
        for t in path[k:]:
            self.own.append(int(t))
            text.append(int(t))

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        if n_max <= 0 or not path:
            return Proposal([], [], [])
        path = path if isinstance(path, list) else [int(t) for t in path]
        self._sync(path)
        state, m = self.own.repeat()
        best = continuation(self.own, state, m, n_max, p_min, self.n_alternatives) if m else Proposal([], [], [])
        if self.corpus is not None:
            with self.corpus.reading() as sam:
                state, m = sam.match(path[-MATCH_WINDOW:])
                if m:
                    other = continuation(sam, state, m, n_max, p_min, self.n_alternatives)
                    if _score(other) > _score(best):
                        best = other
        return best

    def close(self) -> None:
        pass
