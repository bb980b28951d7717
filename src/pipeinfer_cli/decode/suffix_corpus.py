"""What a job's suffix drafter remembers of its earlier requests: their prompts and answers, in
one suffix automaton (`suffix_automaton.py`), at most `cap` tokens, the oldest dropped.

Each finished request is one document (`add`: its prompt and committed tokens). Past the cap, the
oldest documents are dropped until the corpus holds three quarters of it, and the automaton is
built again from what is kept: a suffix automaton cannot forget its beginning, and rebuilding only
every quarter of a cap keeps the cost per token learnt constant. A document longer than the cap
keeps its last `cap` tokens.

Requests of `serve --parallel N` draft and finish on threads of their own: reading (`reading()`)
and adding hold one lock.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from .suffix_automaton import SuffixAutomaton

DEFAULT_CAP = 65536  # tokens kept: about 2 states per token, some tens of MB in Python


class SuffixCorpus:
    """Earlier requests' token texts, bounded by a token cap, in a suffix automaton."""

    def __init__(self, cap: int = DEFAULT_CAP):
        if cap < 1:
            raise ValueError("a suffix corpus keeps at least one token")
        self.cap = cap
        self.docs: deque[list[int]] = deque()
        self.n_tokens = 0  # tokens of the documents kept (separators not counted)
        self.n_learnt = 0  # documents added, kept or since dropped
        self.n_dropped = 0
        self.sam = SuffixAutomaton()
        self._lock = threading.Lock()

    def add(self, tokens: list[int]) -> None:
        """Learn one finished request: its prompt and the tokens it committed."""
        doc = [int(t) for t in tokens][-self.cap:]
        if not doc:
            return
        with self._lock:
            self.docs.append(doc)
            self.n_tokens += len(doc)
            self.n_learnt += 1
            if self.n_tokens <= self.cap:
                self.sam.extend(doc)
                self.sam.end_document()
                return
            keep = self.cap - self.cap // 4
            while self.n_tokens > keep and len(self.docs) > 1:
                self.n_tokens -= len(self.docs.popleft())
                self.n_dropped += 1
            if self.n_tokens > keep:  # the newest alone is over the low mark: keep its end
                self.docs[0] = self.docs[0][-keep:]
                self.n_tokens = len(self.docs[0])
            self.sam = SuffixAutomaton()
            for d in self.docs:
                self.sam.extend(d)
                self.sam.end_document()

    @contextmanager
    def reading(self) -> Iterator[SuffixAutomaton]:
        """The automaton, not changed by another thread while the caller reads it."""
        with self._lock:
            yield self.sam

    def __len__(self) -> int:
        return self.n_tokens
