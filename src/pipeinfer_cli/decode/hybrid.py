"""Hybrid drafting (`--draft lookup+MODEL`): prompt lookup where it has a confident match, a draft
model elsewhere, as llama.cpp lets its model-free drafter take precedence over the draft model.

Precedence: lookup's proposal is used when its first token's confidence (`lookup.py`: the hit rate
of the match length, scaled by how many earlier occurrences agree) is at least `LOOKUP_FIRST_P`
and the caller's `p_min`; the draft model drafts otherwise. Lookup costs no model, so asking it
first is free; copy-heavy spans (code being edited, a quoted document) then cost no draft model
time, and the rest still gets a model's guesses. Every proposal names its source
(`Proposal.source`), so acceptance is counted per source (`Acceptance.by_source`).

`HybridDrafter` wraps a model drafted synchronously (on this rank); `HybridAsyncDrafter` a draft
rank's proxy: a confident lookup answers the request on the spot, and the draft rank is asked only
otherwise.
"""

from __future__ import annotations

from .draft_spec import HYBRID_PREFIX
from .drafters import Proposal
from .lookup import LookupDrafter, hit_rate
from .tree import confident

# Lookup goes first from a 3-token match whose earlier occurrences all agree: below that its
# proposals are right less often than a draft model's of the same family.
LOOKUP_FIRST_P = hit_rate(3)


class HybridDrafter:
    """Lookup first when it is confident, else the model (a head-local `Drafter`)."""

    def __init__(self, model, lookup: LookupDrafter | None = None):
        self.model, self.lookup = model, lookup or LookupDrafter()

    @property
    def name(self) -> str:
        return HYBRID_PREFIX + self.model.name

    @property
    def has_prompt_pass(self) -> bool:
        return self.model.has_prompt_pass

    @property
    def kv_tokens(self) -> list[int]:
        return self.model.kv_tokens

    def from_lookup(self, path: list[int], n_max: int, p_min: float) -> Proposal | None:
        """Lookup's proposal if it takes precedence here, else None."""
        prop = self.lookup.propose(path, n_max, p_min)
        if prop.tokens and prop.probs[0] >= max(p_min, LOOKUP_FIRST_P):
            prop.source = "lookup"
            return prop
        return None

    def start(self, prompt: list[int], reuse: int = 0) -> None:
        self.model.start(prompt, reuse)

    def read_context(self, tokens: list[int]) -> None:
        self.model.read_context(tokens)

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        prop = self.from_lookup(path, n_max, p_min)
        if prop is None:
            prop = self.model.propose(path, n_max, p_min)
            prop.source = "model"
        return prop

    def close(self) -> None:
        self.model.close()


class HybridAsyncDrafter(HybridDrafter):
    """Lookup first, else a draft rank asked asynchronously (`AsyncDrafter`)."""

    def __init__(self, model, lookup: LookupDrafter | None = None):
        super().__init__(model, lookup)
        self.local: Proposal | None = None  # lookup's answer to the outstanding request

    @property
    def outstanding(self) -> bool:
        return self.local is not None or self.model.outstanding

    def request(self, path: list[int], n_max: int, p_min: float) -> None:
        assert not self.outstanding, "one draft request at a time"
        prop = self.from_lookup(path, n_max, p_min)
        if prop is not None:
            prop.base = list(path)
            self.local = prop
        else:
            self.model.request(path, n_max, p_min)

    def ready(self) -> bool:
        return self.local is not None or self.model.ready()

    def free_draft(self, path: list[int], threshold: float, n_max: int) -> list[int]:
        """Lookup's confident tokens continuing path, if it takes precedence there: pipeinfer asks at
        every step, also while the draft rank drafts (lookup costs nothing)."""
        prop = self.from_lookup(path, n_max, threshold) if n_max > 0 else None
        return prop.tokens[:confident(prop.probs, threshold)] if prop is not None else []

    def _model_reply(self, prop: Proposal | None) -> Proposal | None:
        if prop is not None:
            prop.source = "model"
        return prop

    def poll(self) -> Proposal | None:
        if self.local is not None:
            prop, self.local = self.local, None
            return prop
        return self._model_reply(self.model.poll())

    def wait(self) -> Proposal | None:
        if self.local is not None:
            return self.poll()
        return self._model_reply(self.model.wait())

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        self.request(path, n_max, p_min)
        return self.wait()
