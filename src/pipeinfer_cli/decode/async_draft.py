"""Asynchronous drafting with a dedicated draft rank (`--layer-split …/1`), as pipeinfer mode does it.

The head keeps one draft request outstanding for the path beyond the runs in flight, and verifies
results while the draft rank drafts. A reply is launched only if the path it continues is still
consistent with the current path (the current path is a prefix of the reply's path + draft);
otherwise it is dropped and the head asks again. A reply that is consistent but not confident
enough is kept, in case the path advances into it, and judged again only once the path changes;
nor is the draft rank asked again for that path.
"""

from __future__ import annotations

from collections.abc import Callable

from .drafters import AsyncDrafter, Proposal
from .tree import confident


class AsyncDraft:
    """The outstanding request to a draft rank and its reply, until the reply is launched or dropped."""

    def __init__(self, drafter: AsyncDrafter, n_draft: int):
        self.drafter, self.n_draft = drafter, n_draft
        self.reply: Proposal | None = None  # a reply not launched yet (`base`: the path it continues)
        # The path at which the draft was judged not confident enough: do not judge the reply
        # again, nor ask the draft rank again, until the path changes.
        self.refused: list[int] | None = None
        self.lag = 0  # tokens the path advanced during the last draft round trip

    @property
    def busy(self) -> bool:
        """A request or a reply is pending: no new request now."""
        return self.drafter.outstanding or self.reply is not None

    def request(self, path: list[int], limit: int, room: int | None = None) -> None:
        """Ask for a draft continuing `path`, unless a request or a reply is pending.

        limit: how many tokens may still follow `path` (the draft window's hard end); room: how
        many the head would launch after `path` (draft_budget.py; None: --n-draft).
        """
        want = self.n_draft if room is None else min(self.n_draft, room)
        if self.busy or min(want, limit) <= 0 or path == self.refused:
            return
        # The path keeps moving while the draft rank drafts (the head decodes on): ask for as many
        # more tokens as it moved during the last round trip, so the reply still reaches ahead, and
        # with no confidence cutoff: the head applies p_accept + p_adjust to the part it launches
        # (the tokens the path has meanwhile committed need no confidence). That was faster than
        # cutting the draft short at the draft rank (BENCHMARKS.md, "Figures formerly quoted in
        # source comments").
        self.drafter.request(path, min(want + self.lag, limit), 0.0)

    def receive(self, path: Callable[[], list[int]]) -> int:
        """Take the reply if it has arrived (without waiting); path(): the current path. Returns
        how many tokens it proposes (0 without a reply)."""
        if self.reply is None and self.drafter.outstanding:
            prop = self.drafter.poll()
            if prop is not None:
                self.reply = prop
                self.lag = min(max(len(path()) - len(prop.base), 0), 2 * self.n_draft)
                return len(prop.tokens)
        return 0

    def arrived(self) -> bool:
        """A reply has arrived and waits to be received."""
        return self.drafter.outstanding and self.drafter.ready()

    def take(self, path: list[int], threshold: float, n_max: int) -> list[int] | None:
        """The part of the pending reply to launch after `path`, or why not.

        Returns the draft tokens to launch (the reply is then used up); [] if the reply no longer
        continues the path (the path moved on in another direction, a rejection, or past the whole
        draft): it is dropped, and the head may ask again; None if there is nothing to launch now
        (no reply, or not confident enough at this path: it is kept for a later path).
        """
        r = self.reply
        if r is None or path == self.refused:
            return None
        cand = r.base + r.tokens
        if not r.tokens and r.base == path:
            # The draft has nothing to propose here: asking again for the same path would only
            # get the same empty answer.
            self.reply, self.refused = None, list(path)
            return None
        if len(cand) <= len(path) or cand[:len(path)] != path:
            self.reply = None
            return []
        # The tokens the path has already committed or launched need no confidence.
        probs = [1.0] * len(r.base) + r.probs
        keep = min(confident(probs[len(path):], threshold), max(n_max, 0))
        if keep == 0:
            self.refused = path
            return None
        self.reply = None
        return cand[len(path):len(path) + keep]

    def drain(self) -> int:
        """Wait for the outstanding request's reply, if any, and forget it (end of a request).
        Returns how many tokens that reply proposed (0 without one)."""
        prop = self.drafter.wait()
        self.reply = None
        self.drafter.end_stream()  # a draft rank that streams ahead stops
        return len(prop.tokens) if prop is not None else 0
