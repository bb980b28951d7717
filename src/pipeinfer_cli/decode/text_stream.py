"""Committed tokens to text as the user sees it: UTF-8 completed across tokens, stop strings cut.

Text that could still turn out to be the start of a stop string is held back, so a stop string
never reaches the screen, as with llama-server's `stop`. Stopping is decided token by token at
commit time, so every mode stops on the same token.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


class TextStream:
    def __init__(self, piece: Callable[[int], bytes], stop: Sequence[str] = ()):
        self._piece = piece
        self._stop = [s for s in stop if s]
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded, not yet shown: may be the start of a stop string
        self.text = ""  # everything shown so far
        self.stopped = False  # a stop string appeared; nothing more is shown
        self.stop_string: str | None = None

    def push(self, token: int) -> str:
        """Text to show now for one committed token ('' while held back or after a stop)."""
        if self.stopped:
            return ""
        self._pending += self._utf8.decode(self._piece(token))
        if not self._stop:
            return self._emit(len(self._pending))
        hits = [(i, s) for s in self._stop if (i := self._pending.find(s)) >= 0]
        if hits:
            cut, self.stop_string = min(hits)
            self.stopped = True
            shown = self._emit(cut)
            self._pending = ""
            return shown
        return self._emit(len(self._pending) - self._held_suffix())

    def finish(self) -> str:
        """The rest of the text at the end of generation."""
        if self.stopped:
            return ""
        self._pending += self._utf8.decode(b"", final=True)
        return self._emit(len(self._pending))

    def _held_suffix(self) -> int:
        """Length of the longest end of the pending text that begins some stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(s[:k]):
                    best = k
                    break
        return best

    def _emit(self, n: int) -> str:
        shown, self._pending = self._pending[:n], self._pending[n:]
        self.text += shown
        return shown
