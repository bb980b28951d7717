"""A draft of another vocabulary: paths and proposals translated through text.

The policies speak the target's tokens only. `VocabBridge` turns a target path into the draft's
tokens (the draft's own tokenization of the path's text) and the draft's proposal back into target
tokens (the target's tokenization of the proposed text, continuing the path's tokens). The target
verifies its own tokens, so the output is what it is without a draft; the translation only decides
how often the draft is right.

Draft side. The draft's token history is its tokenization of the path's text, kept incrementally:
when the text changes (tokens committed, a rejection), the draft tokens that end within the
unchanged prefix are kept except the last `REWIND` of them, and the rest of the text is tokenized
afresh from there, since a token boundary near the change may move ("Hel" + "lo" is one token
"Hello" once both are there). The drafter then trims its KV cache to the prefix it shares with that
history and feeds the rest (`LlamaDrafter._sync`), so after a partial acceptance the draft's cache
holds exactly its tokenization of the committed text.

Target side. The proposed text is tokenized for the target together with up to `LOOKBACK` of the
path's last tokens, and used only if those come out as the path's own tokens (the boundary the path
ends on is one the target's tokenizer agrees with); otherwise with fewer, down to the proposed text
alone. The last target token of a proposal is dropped unless the draft ended the text (an end of
generation): it may be a word the draft's next token would have continued. So the drafter asks the
draft for one token more than the policy asked for.

Confidence (`Proposal.probs`, one per target token): each draft token's probability goes to the
first target token that needs any of its bytes, and a target token's confidence is the product of
the probabilities it received (1.0 if none). So a target token spelled by several draft tokens is
as likely as all of them, the second and later target tokens of one draft token are certain once
the first was accepted, and the product over a proposal is the draft's probability of its text.

Text is cut at complete UTF-8 characters before either tokenizer sees it: a path may end inside a
character (a byte token), and the draft's proposal must then spell that character's rest first.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Protocol

from .drafters import Proposal

LOOKBACK = 4  # path tokens tokenized again with the proposed text (a token boundary agreed on)
REWIND = 4  # draft tokens tokenized again before the first changed byte of the path's text


class TextCodec(Protocol):
    """What the bridge needs of a tokenizer (runtime/tokenizer.py's `Tokenizer` has it)."""

    add_bos: bool
    bos: int

    def encode_bytes(self, text: bytes, add_bos: bool) -> list[int]: ...

    def text_piece(self, token: int) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...


def complete_utf8(text: bytes) -> int:
    """Length of the longest prefix of text that ends on a complete UTF-8 character."""
    n = len(text)
    i = n
    while i > 0 and n - i < 4 and (text[i - 1] & 0xC0) == 0x80:
        i -= 1
    if i == 0:
        return n
    lead = text[i - 1]
    need = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
    return n if n - (i - 1) >= need else i - 1


def is_char_start(text: bytes, at: int) -> bool:
    return at >= len(text) or (text[at] & 0xC0) != 0x80


def common_prefix(a, b) -> int:
    """Length of the common prefix of two sequences (lists or bytes), by bisection on slices."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # a[:lo] == b[:lo], a[:hi+1] != b[:hi+1] at most
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def spans(pieces: list[bytes], start: int = 0) -> list[int]:
    """Byte end of each piece, laid end to end from `start`."""
    out, at = [], start
    for p in pieces:
        at += len(p)
        out.append(at)
    return out


@dataclass
class DraftView:
    """A target path as the draft sees it."""

    tokens: list[int]  # the draft's tokenization of text[:covered]
    text: bytes  # the path's text
    covered: int  # bytes of text the draft tokens spell (the text cut at a complete character)


class VocabBridge:
    """Target paths to draft tokens and draft proposals to target tokens, for one drafter."""

    def __init__(self, target: TextCodec, draft: TextCodec, map_alternatives: bool = False):
        self.target, self.draft = target, draft
        self.map_alternatives = map_alternatives  # token trees: runner-ups translated too (a tokenization each)
        self._path: list[int] = []  # the target path last rendered, its tokens' byte ends and text
        self._ends: list[int] = []
        self._text = b""
        self._dtoks: list[int] = []  # the draft's tokenization of _dtext, and each token's byte end
        self._dends: list[int] = []
        self._dtext = b""

    def reset(self) -> None:
        self.__init__(self.target, self.draft, self.map_alternatives)

    # -- target path -> draft tokens -------------------------------------------------------------
    def text_of(self, path: list[int]) -> bytes:
        """The path's text (a leading BOS spells nothing: the draft adds its own)."""
        k = common_prefix(self._path, path)
        del self._path[k:], self._ends[k:]
        text = bytearray(self._text[:self._ends[-1] if k else 0])
        for t in path[k:]:
            if not self._path and t == self.target.bos:
                piece = b""
            else:
                piece = self.target.text_piece(t)
            text += piece
            self._path.append(t)
            self._ends.append(len(text))
        self._text = bytes(text)
        return self._text

    def draft_view(self, path: list[int]) -> DraftView | None:
        """The draft's tokens for the path's text; None if its tokenizer does not spell the text back."""
        text = self.text_of(path)
        covered = complete_utf8(text)
        toks = self._draft_tokens(text[:covered])
        return None if toks is None else DraftView(toks, text, covered)

    def _draft_tokens(self, text: bytes) -> list[int] | None:
        d = self.draft
        n_bos = 1 if d.add_bos else 0
        k = bisect_right(self._dends, common_prefix(self._dtext, text))  # draft tokens inside the unchanged prefix
        k = max(k - REWIND, n_bos)
        while k > n_bos and not is_char_start(text, self._dends[k - 1]):
            k -= 1
        if k <= n_bos:
            toks = d.encode_bytes(text, add_bos=d.add_bos)
            ends = spans([b"" if i < n_bos else d.text_piece(t) for i, t in enumerate(toks)])
        else:
            start = self._dends[k - 1]
            new = d.encode_bytes(text[start:], add_bos=False)
            toks = self._dtoks[:k] + new
            ends = self._dends[:k] + spans([d.text_piece(t) for t in new], start)
        if (ends[-1] if ends else 0) != len(text):
            self._dtoks, self._dends, self._dtext = [], [], b""
            return None
        self._dtoks, self._dends, self._dtext = toks, ends, text
        return list(toks)

    # -- draft proposal -> target tokens -------------------------------------------------------
    def to_target(self, path: list[int], view: DraftView, prop: Proposal, n_max: int) -> Proposal:
        """The draft's proposal (continuing view.tokens) as target tokens continuing `path`."""
        out = Proposal([], [], [])
        self.text_of(path)  # the bridge measures from the path's tokens (another path may have come since)
        pieces, probs, eog = self._proposed_pieces(prop)
        carry = view.text[view.covered:]  # bytes of the path the draft's tokens do not spell yet
        text = b"".join(pieces)
        if not text.startswith(carry):
            return out
        d_ends = [e - len(carry) for e in spans(pieces)]  # relative to the path's end
        extra = text[len(carry):]
        extra = extra[:complete_utf8(extra)]
        new = self._extend(len(path), extra) if extra else []
        if new is None:
            return out
        if eog is not None and len(extra) == len(text) - len(carry):
            new.append(eog)  # the draft ended the text where the target's end-of-generation token goes
        elif new:
            new.pop()  # may be cut short by the draft's last token
        new = new[:n_max]
        t_ends = spans([self.target.text_piece(t) for t in new])
        out.tokens, out.probs = new, combine(d_ends, probs, t_ends, len(carry))
        out.alternatives = self._alternatives(path, prop, pieces, d_ends, new, t_ends, len(carry))
        return out

    def _proposed_pieces(self, prop: Proposal) -> tuple[list[bytes], list[float], int | None]:
        """The proposal's pieces up to an end of generation, and the target token that ends it there
        (None when the draft did not end the text, or its end token has no target counterpart)."""
        pieces, probs = [], []
        for t, p in zip(prop.tokens, prop.probs):
            if self.draft.is_eog(t):
                mapped = self.target.encode_bytes(self.draft.text_piece(t), add_bos=False)
                if len(mapped) == 1 and self.target.is_eog(mapped[0]):
                    probs.append(p)
                    pieces.append(b"")
                    return pieces, probs, mapped[0]
                break
            pieces.append(self.draft.text_piece(t))
            probs.append(p)
        return pieces, probs, None

    def _extend(self, n_path: int, extra: bytes, more: list[int] | None = None) -> list[int] | None:
        """Target tokens spelling `extra` after path[:n_path] + more, at a boundary the target's tokenizer
        agrees with; None if there is none (or the tokens do not spell `extra` back)."""
        more = more or []
        base = self._path[:n_path] + more
        more_pieces = [self.target.text_piece(t) for t in more]
        path_end = self._ends[n_path - 1] if n_path else 0
        ends = self._ends[:n_path] + spans(more_pieces, path_end)
        text = self._text[:path_end] + b"".join(more_pieces)
        for lb in range(min(LOOKBACK, len(base)), -1, -1):
            a = len(base) - lb
            start = ends[a - 1] if a else 0
            if (a == 0 and base and base[0] == self.target.bos) or not is_char_start(text, start):
                continue
            toks = self.target.encode_bytes(text[start:] + extra, add_bos=False)
            if toks[:lb] == base[a:]:
                new = toks[lb:]
                if sum(len(self.target.text_piece(t)) for t in new) == len(extra):
                    return new
        return None

    def _alternatives(self, path, prop: Proposal, pieces, d_ends, new, t_ends, n_carry) -> list[list[tuple[int, float]]]:
        """Runner-ups as target tokens, where a draft token starts where a target token does (an
        agreed boundary): the first target token of the text with the runner-up in its place."""
        alts: list[list[tuple[int, float]]] = [[] for _ in new]
        if not self.map_alternatives:
            return alts
        starts = {0: 0, **{e: j + 1 for j, e in enumerate(t_ends[:-1])}}  # byte start -> target position
        for i, cands in enumerate(prop.alternatives[:len(pieces)]):
            at = (d_ends[i - 1] if i else -n_carry)
            j = starts.get(at)
            if j is None or j >= len(new) or not cands:
                continue
            for tok, p in cands:
                if self.draft.is_eog(tok):
                    continue
                piece = self.draft.text_piece(tok)
                piece = piece[:complete_utf8(piece)]
                got = self._extend(len(path), piece, new[:j]) if piece else None
                if got and got[0] != new[j]:
                    alts[j].append((got[0], p))
        return alts


def combine(d_ends: list[int], probs: list[float], t_ends: list[int], n_carry: int = 0) -> list[float]:
    """Each target token's confidence: the product of the probabilities of the draft tokens whose
    first new byte it is the first to need. d_ends, t_ends: byte ends relative to the path's end;
    the first draft token starts n_carry bytes before it (the rest of a character the path began)."""
    out = [1.0] * len(t_ends)
    j = 0
    for i, p in enumerate(probs):
        if d_ends[i] <= 0:
            continue  # spells only bytes the path already has
        start = max(d_ends[i - 1] if i else -n_carry, 0)
        while j < len(t_ends) and t_ends[j] <= start:
            j += 1
        if j == len(t_ends):
            break
        out[j] *= p
    return out
