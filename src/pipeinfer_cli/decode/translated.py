"""Drafters whose model has another vocabulary than the target's, behind the target's tokens.

`TranslatedDrafter` wraps a draft model on this rank (`LlamaDrafter`), `TranslatedAsyncDrafter` a
draft rank's proxy (`RemoteDrafter`): the draft rank drafts in its own tokens and knows nothing of
the target; the head translates the path it sends and the reply it gets (`vocab_bridge.py`). Both
are `Drafter`s of target tokens, so every mode and the token trees use them unchanged.
"""

from __future__ import annotations

from .drafters import Proposal
from .vocab_bridge import DraftView, TextCodec, VocabBridge


class TranslatedDrafter:
    """A draft model of another vocabulary, proposing target tokens (`vocab_bridge.py`)."""

    def __init__(self, inner, target: TextCodec, draft: TextCodec, n_ctx: int, map_alternatives: bool = False):
        self.inner, self.n_ctx = inner, n_ctx
        self.bridge = VocabBridge(target, draft, map_alternatives)

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def has_prompt_pass(self) -> bool:
        return self.inner.has_prompt_pass

    @property
    def kv_tokens(self) -> list[int]:
        return self.inner.kv_tokens

    def _view(self, path: list[int], n_max: int) -> DraftView | None:
        """The path in the draft's tokens, or None where the draft cannot draft it: its tokenizer does
        not spell the text back, or the draft's tokens and n_max more would not fit its context (the
        draft's tokenization may be longer than the target's)."""
        view = self.bridge.draft_view(path)
        if view is None or not view.tokens or len(view.tokens) + n_max + 1 > self.n_ctx:
            return None
        return view

    def start(self, prompt: list[int], reuse: int = 0) -> None:
        """Read the prompt's text in the draft's tokens; reuse: the draft keeps what its own cache
        shares with them (its prefix cache decides), whenever the target keeps anything."""
        self.bridge.reset()
        view = self._view(prompt, 0) if prompt else None
        toks = view.tokens if view is not None else []
        self.inner.start(toks, len(toks) if reuse > 0 else 0)

    def read_context(self, tokens: list[int]) -> None:
        view = self._view(tokens, 0) if tokens else None
        self.inner.read_context(view.tokens if view is not None else [])

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        view = self._view(path, n_max + 1) if n_max > 0 else None
        if view is None:
            return Proposal([], [], [])
        # One draft token more than asked: the last target token of a translation is dropped
        # (a word the next draft token might continue).
        return self.bridge.to_target(path, view, self.inner.propose(view.tokens, n_max + 1, p_min), n_max)

    def close(self) -> None:
        self.inner.close()
        close_codec = getattr(self.bridge.draft, "close", None)  # the draft's vocabulary, loaded for this drafter
        if close_codec is not None:
            close_codec()


class TranslatedAsyncDrafter(TranslatedDrafter):
    """A draft rank of another vocabulary, asked asynchronously (`AsyncDrafter`) in target tokens.

    A path the draft cannot draft is answered on the spot with an empty proposal, which
    `AsyncDraft` takes as "nothing to launch here" until the path changes."""

    def __init__(self, inner, target: TextCodec, draft: TextCodec, n_ctx: int, map_alternatives: bool = False):
        super().__init__(inner, target, draft, n_ctx, map_alternatives)
        self.requested: tuple[list[int], DraftView | None, int] | None = None  # target path, its view, n_max

    @property
    def outstanding(self) -> bool:
        return self.requested is not None

    def request(self, path: list[int], n_max: int, p_min: float) -> None:
        assert self.requested is None, "one draft request at a time"
        view = self._view(path, n_max + 1) if n_max > 0 else None
        self.requested = (list(path), view, n_max)
        if view is not None:
            self.inner.request(view.tokens, n_max + 1, p_min)

    def ready(self) -> bool:
        return self.requested is not None and (self.requested[1] is None or self.inner.ready())

    def _answer(self, reply: Proposal | None) -> Proposal | None:
        path, view, n_max = self.requested
        if view is not None and reply is None:
            return None
        self.requested = None
        out = Proposal([], [], []) if view is None else self.bridge.to_target(path, view, reply, n_max)
        out.base = path
        return out

    def poll(self, whole: bool = False) -> Proposal | None:
        if self.requested is None:
            return None
        # The whole reply: a draft rank streams token by token, and a part of a draft token's text
        # may translate to no target token at all (which would read as "nothing to propose here").
        return self._answer(self.inner.poll(whole=True) if self.requested[1] is not None else None)

    def wait(self, whole: bool = False) -> Proposal | None:
        if self.requested is None:
            return None
        return self._answer(self.inner.wait(whole=True) if self.requested[1] is not None else None)

    def end_stream(self) -> None:
        """The end of a request: the draft rank stops drafting ahead (RemoteDrafter.end_stream)."""
        self.requested = None
        self.inner.end_stream()

