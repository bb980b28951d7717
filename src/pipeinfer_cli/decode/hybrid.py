"""Hybrid drafting (`--draft lookup+MODEL`, `--draft suffix+MODEL`): a model-free drafter (prompt
lookup, or suffix drafting) where it has a confident match, a draft model elsewhere, as llama.cpp
lets its model-free drafter take precedence over the draft model.

Precedence: the front drafter's proposal is used when its first token's confidence (`lookup.py`:
the hit rate of the match length, scaled by how many earlier occurrences agree; `suffix.py`: the
same from the match's frequency statistics) is at least `LOOKUP_FIRST_P` and the caller's
`p_min`; the draft model drafts otherwise. The front drafter costs no model, so asking it first is
free; copy-heavy spans (code being edited, a quoted document, an answer like an earlier one) then
cost no draft model time, and the rest still gets a model's guesses. Every proposal names its
source (`Proposal.source`: the front drafter's name, or "model"), so acceptance is counted per
source (`Acceptance.by_source`).

`HybridDrafter` wraps a model drafted synchronously (on this rank); `HybridAsyncDrafter` a draft
rank's proxy: a confident front drafter answers the request on the spot, and the draft rank is
asked only otherwise.
"""

from __future__ import annotations

from .drafters import Drafter, Proposal
from .lookup import LookupDrafter, hit_rate
from .tree import confident

# The front drafter goes first from a 3-token match whose earlier occurrences all agree: below that
# lookup's proposals are right less often than a draft model's of the same family.
LOOKUP_FIRST_P = hit_rate(3)


class HybridDrafter:
    """A model-free drafter first when it is confident, else the model (a head-local `Drafter`).
    front: prompt lookup unless given (a `SuffixDrafter` for suffix+MODEL)."""

    def __init__(self, model, front: Drafter | None = None):
        self.model, self.front = model, front or LookupDrafter()

    @property
    def name(self) -> str:
        return self.front.name + "+" + self.model.name

    @property
    def front_name(self) -> str:
        """The source that the front drafter's proposals name (`Proposal.source`)."""
        return self.front.name

    @property
    def has_prompt_pass(self) -> bool:
        return self.model.has_prompt_pass

    @property
    def kv_tokens(self) -> list[int]:
        return self.model.kv_tokens

    def from_front(self, path: list[int], n_max: int, p_min: float) -> Proposal | None:
        """The front drafter's proposal if it takes precedence here, else None."""
        prop = self.front.propose(path, n_max, p_min)
        if prop.tokens and prop.probs[0] >= max(p_min, LOOKUP_FIRST_P):
            prop.source = self.front.name
            return prop
        return None

    def start(self, prompt: list[int], reuse: int = 0) -> None:
        self.front.start(prompt, reuse)
        self.model.start(prompt, reuse)

    def read_context(self, tokens: list[int]) -> None:
        self.model.read_context(tokens)

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        prop = self.from_front(path, n_max, p_min)
        if prop is None:
            prop = self.model.propose(path, n_max, p_min)
            prop.source = "model"
        return prop

    def close(self) -> None:
        self.model.close()


class HybridAsyncDrafter(HybridDrafter):
    """Lookup first, else a draft rank asked asynchronously (`AsyncDrafter`)."""

    def __init__(self, model, front: Drafter | None = None):
        super().__init__(model, front)
        self.local: Proposal | None = None  # the front drafter's answer to the outstanding request

    @property
    def outstanding(self) -> bool:
        return self.local is not None or self.model.outstanding

    def request(self, path: list[int], n_max: int, p_min: float) -> None:
        assert not self.outstanding, "one draft request at a time"
        prop = self.from_front(path, n_max, p_min)
        if prop is not None:
            prop.base = list(path)
            self.local = prop
        else:
            self.model.request(path, n_max, p_min)

    def ready(self) -> bool:
        return self.local is not None or self.model.ready()

    def free_draft(self, path: list[int], threshold: float, n_max: int) -> list[int]:
        """The front drafter's confident tokens continuing path, if it takes precedence there:
        pipeinfer asks at every step, also while the draft rank drafts (it costs nothing)."""
        prop = self.from_front(path, n_max, threshold) if n_max > 0 else None
        return prop.tokens[:confident(prop.probs, threshold)] if prop is not None else []

    def _model_reply(self, prop: Proposal | None) -> Proposal | None:
        if prop is not None:
            prop.source = "model"
        return prop

    def poll(self, whole: bool = False) -> Proposal | None:
        if self.local is not None:
            prop, self.local = self.local, None
            return prop
        return self._model_reply(self.model.poll(whole))

    def wait(self, whole: bool = False) -> Proposal | None:
        if self.local is not None:
            return self.poll()
        return self._model_reply(self.model.wait(whole))

    def end_stream(self) -> None:
        """The end of a request: the draft rank stops drafting ahead (RemoteDrafter.end_stream)."""
        self.local = None
        self.model.end_stream()
