"""What a draft will get right, for `-M auto`: measured where it can be, assumed (and said so) where not.

- Prompt lookup: measured on the prompt itself. The lookup drafter walks the prompt's tokens and,
  at every position, proposes the next one from what came before; the share it gets right is the
  rate, and the probabilities it gave its right and wrong proposals are the confidences.
- A draft model: the acceptance `pipeinfer calibrate --draft MODEL` measured (a short greedy run
  of the draft against the target on a calibration prompt), when the profile holds it; else
  DEFAULT_ACCEPTANCE, assumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..decode.lookup import LookupDrafter
from .replay import Confidences

if TYPE_CHECKING:
    from .profile import DraftCosts

DEFAULT_ACCEPTANCE = 0.6  # assumed when nothing measured it; -M's help and docs/plan.md state it
LOOKUP_WINDOW = 512  # prompt positions the lookup drafter is tried at (the last ones: the prompt's end is what it continues)


@dataclass
class Acceptance:
    rate: float | None  # None: no draft
    measured: bool
    source: str  # how it was obtained, as the job states it
    confidences: Confidences | None = None

    def describe(self) -> str:
        return f"{'a measured' if self.measured else 'an assumed'} acceptance of {self.rate:.0%} ({self.source})"


def assumed(why: str) -> Acceptance:
    return Acceptance(DEFAULT_ACCEPTANCE, False, f"assumed: {why}")


def lookup_on_prompt(tokens: list[int]) -> Acceptance:
    """How often prompt lookup proposes the prompt's next token, over the prompt itself."""
    drafter, right, wrong = LookupDrafter(), [], []
    for i in range(max(1, len(tokens) - LOOKUP_WINDOW), len(tokens)):
        prop = drafter.propose(tokens[:i], 1, 0.0)
        if prop.tokens:
            (right if prop.tokens[0] == tokens[i] else wrong).append(prop.probs[0])
    n = len(right) + len(wrong)
    if n == 0:
        return Acceptance(0.0, True, f"measured on the prompt: lookup found nothing to propose in its "
                                     f"{len(tokens)} tokens")
    return Acceptance(len(right) / n, True, f"measured on the prompt: lookup proposed {n} of its tokens, "
                                            f"{len(right)} right", Confidences(right, wrong))


def from_profile(draft: DraftCosts | None) -> Acceptance | None:
    """The acceptance `calibrate --draft` measured (profile's draft.acceptance), if it did."""
    rate = draft.acceptance if draft is not None else None
    if rate is None:
        return None
    conf = Confidences(list(draft.confidence_right or []), list(draft.confidence_wrong or []))
    return Acceptance(rate, True, f"measured by calibrate on {draft.acceptance_tokens} tokens of a calibration prompt",
                      conf if conf.right or conf.wrong else None)


def confidences(spec, draft, prompts: list) -> Confidences | None:
    """The measured per-token confidences a synthetic draft (an acceptance rate given or assumed)
    reports, over `prompts` (PromptTraces): a trace's recorded draft chains where it has them (the
    probability of each chain's first token, right or wrong against the target's), prompt lookup's
    on the prompts, a draft model's as calibrate measured them; None where nothing measured them
    (the rate itself is reported then)."""
    recorded = [c for c in (chain_confidences(pt) for pt in prompts) if c is not None]
    if spec.is_lookup:  # spec: the DraftSpec planned for
        recorded = [c for c in (lookup_on_prompt(pt.prompt).confidences for pt in prompts) if c is not None]
    if recorded:
        return Confidences([x for c in recorded for x in c.right], [x for c in recorded for x in c.wrong])
    measured = from_profile(draft)
    return measured.confidences if measured is not None else None


def chain_confidences(pt) -> Confidences | None:
    """From a trace's chains: the draft's probability for its next token after each committed prefix."""
    right, wrong, full = [], [], pt.full
    for i, (toks, probs) in enumerate(zip(pt.chains, pt.chain_probs)):
        at = pt.chains_from + i
        if toks and probs and at < len(full):
            (right if toks[0] == full[at] else wrong).append(probs[0])
    return Confidences(right, wrong) if right or wrong else None
