"""A suffix automaton over token ids, built one token at a time, with occurrence counts.

The automaton of a text has one state per class of substrings that end at the same set of
positions (`endpos`); each state knows its longest string's length (`length`), its suffix link
(the state of its longest suffix in another class) and its transitions (`trans`: token -> state).
Appending a token (`append`) costs about as many steps as the suffix-link chain of the new end is
long: a handful for text, more where a stretch repeats a short period over and over.

What a drafter reads from it:

- `occ[v]`: how many times the strings of state v occur (the size of their endpos set), kept
  exact as tokens are appended, by one step up the suffix-link chain of each new end;
- `recent[v]`: the end position of their most recent occurrence (to prefer it on ties);
- `match(query)`: the longest suffix of a query that occurs in the text, and its state;
- `repeat()`: the longest suffix of the text itself that occurred before (the state the text's
  end links to), which is what continues the text;
- `children(v)`: the tokens that followed the strings of v, with how often each did.

`pop()` takes the last token back (with `undo=True`: each append keeps what it changed), so a
drafter can follow a path whose speculative tail is rolled back. Documents are separated by
`end_document()`, a token of its own (negative, never proposed), so no match runs across two.
Pure Python, no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Undo:
    """What one append changed, to take it back."""

    token: int
    cur: int  # the state it created for the new end
    added: list[int]  # states given a transition on the token to cur
    clone: int  # the clone it split off (-1: none)
    split: int  # the state the clone was split from
    redirected: list[int]  # states whose transition moved from `split` to the clone
    last: int  # the text's end state before
    recent: list[tuple[int, int]]  # (state, its `recent` before) along the new end's chain


class SuffixAutomaton:
    """The suffix automaton of a growing token text (state 0 is the empty string)."""

    def __init__(self, undo: bool = False):
        self.length: list[int] = [0]
        self.link: list[int] = [-1]
        self.trans: list[dict[int, int]] = [{}]
        self.occ: list[int] = [0]
        self.recent: list[int] = [-1]
        self.last = 0
        self.n = 0  # tokens appended (separators included)
        self.n_docs = 0
        self._undo: list[_Undo] | None = [] if undo else None

    def __len__(self) -> int:
        return self.n

    @property
    def n_states(self) -> int:
        return len(self.length)

    def _new_state(self, length: int, link: int, trans: dict[int, int], occ: int, recent: int) -> int:
        self.length.append(length)
        self.link.append(link)
        self.trans.append(trans)
        self.occ.append(occ)
        self.recent.append(recent)
        return len(self.length) - 1

    def append(self, token: int) -> None:
        """Extend the text by one token."""
        length, link, trans = self.length, self.link, self.trans
        pos = self.n
        cur = self._new_state(length[self.last] + 1, 0, {}, 0, pos)
        added: list[int] = []
        p = self.last
        while p != -1 and token not in trans[p]:
            trans[p][token] = cur
            added.append(p)
            p = link[p]
        clone, q, redirected = -1, -1, []
        if p != -1:
            q = trans[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = self._new_state(length[p] + 1, link[q], dict(trans[q]), self.occ[q], self.recent[q])
                while p != -1 and trans[p].get(token) == q:
                    trans[p][token] = clone
                    redirected.append(p)
                    p = link[p]
                link[q] = link[cur] = clone
        # The new end position belongs to every state on its suffix-link chain.
        recent = []
        v = cur
        while v > 0:
            self.occ[v] += 1
            if self._undo is not None:
                recent.append((v, self.recent[v]))
            self.recent[v] = pos
            v = link[v]
        if self._undo is not None:
            self._undo.append(_Undo(token, cur, added, clone, q, redirected, self.last, recent))
        self.last = cur
        self.n += 1

    def extend(self, tokens) -> None:
        for t in tokens:
            self.append(int(t))

    def end_document(self) -> None:
        """Close the current document with a separator of its own: later matches stop at it."""
        self.n_docs += 1
        self.append(-self.n_docs)

    def pop(self) -> None:
        """Take the last appended token back (an automaton built with undo=True)."""
        assert self._undo, "pop needs an automaton built with undo=True and a token to take back"
        u = self._undo.pop()
        for v, before in u.recent:
            self.occ[v] -= 1
            self.recent[v] = before
        token = u.token
        for p in u.redirected:
            self.trans[p][token] = u.split
        if u.clone != -1:
            self.link[u.split] = self.link[u.clone]
        for p in u.added:
            del self.trans[p][token]
        for s in sorted((u.cur, u.clone), reverse=True):
            if s != -1:
                assert s == len(self.length) - 1
                for arr in (self.length, self.link, self.trans, self.occ, self.recent):
                    arr.pop()
        self.last = u.last
        self.n -= 1

    def truncate(self, n: int) -> None:
        """Take tokens back until the text has n."""
        while self.n > n:
            self.pop()

    # -- reading -----------------------------------------------------------------------------
    def match(self, query) -> tuple[int, int]:
        """(state, length): the longest suffix of `query` that occurs in the text, and its state
        (0 and 0 when not even its last token does)."""
        trans, link, length = self.trans, self.link, self.length
        v = m = 0
        for t in query:
            while v and t not in trans[v]:
                v = link[v]
                m = length[v]
            nxt = trans[v].get(t)
            if nxt is None:
                v = m = 0
            else:
                v, m = nxt, m + 1
        return v, m

    def repeat(self) -> tuple[int, int]:
        """(state, length): the longest suffix of the text that also occurred earlier in it."""
        v = self.link[self.last] if self.last else 0
        return max(v, 0), self.length[v] if v > 0 else 0

    def children(self, v: int) -> tuple[list[tuple[int, int, int, int]], int]:
        """([(token, count, state, most recent end)], total): what followed the strings of v, and
        how many of their occurrences were followed by anything (a document's end included)."""
        occ, recent = self.occ, self.recent
        out, total = [], 0
        for t, s in self.trans[v].items():
            c = occ[s]
            total += c
            if t >= 0:
                out.append((t, c, s, recent[s]))
        return out, total
