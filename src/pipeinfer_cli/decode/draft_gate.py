"""Whether PipeInfer may draft now: a gate the policy asks, and tells what its runs cost.

`AlwaysDraft` lets every draft through (several stages, a draft rank, or --spec-policy always).
`EconomyGate` is the account of draft_economy.py for a drafter on the head of a one-stage
pipeline, with what belongs to it: the job's memory of hopeless drafters, and the draft model's
prompt pass, deferred until a probe says the draft may pay. The policy only asks `may_draft()`,
whether the next draft is a `probe`, and reports drafting, runs and acceptances.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .draft_economy import DraftEconomy, DraftMemory

if TYPE_CHECKING:
    from .drafters import AsyncDrafter, Drafter


class AlwaysDraft:
    """Every draft goes ahead; the prompt pass (if any) runs at once."""

    def __init__(self, prompt_pass: Callable[[], None] | None = None):
        if prompt_pass is not None:
            prompt_pass()

    def may_draft(self) -> bool:
        return True

    @property
    def probe(self) -> bool:
        """The next draft is a probe from the last tokens (the draft has not read the prompt)."""
        return False

    def probed(self) -> None: ...

    def drafted(self, seconds: float) -> None: ...

    def launched(self, speculative: bool, n_rows: int, seconds: float) -> None: ...

    def accepted(self, n: int) -> None: ...

    def report(self, runs) -> None: ...


class EconomyGate:
    """Drafting on one stage only while it pays (draft_economy.py), for a drafter named `drafter`."""

    def __init__(self, drafter: str, memory: DraftMemory, prompt_pass: Callable[[], None] | None = None):
        self.drafter, self.memory = drafter, memory
        self.economy = DraftEconomy()
        self.economy.off = drafter in memory.hopeless  # an earlier request of this job found it cannot pay here
        self.prompt_pass = prompt_pass  # the draft model's pass over the prompt, not run yet
        self._probed = False  # the probe that stands in for the prompt pass was drafted

    def may_draft(self) -> bool:
        """Whether to draft now (every speculative run so far verified): a probe that ruled the
        draft hopeless, or a balance in deficit, says no; a probe that passed runs the prompt pass."""
        econ = self.economy
        if self.prompt_pass is not None and self._probed and not econ.off:
            if not econ.cost_probe_passed():
                self.memory.hopeless.add(self.drafter)
                return False
            self.prompt_pass()  # the probe did not rule the draft out: it reads the prompt now
            self.prompt_pass = None
        elif not econ.may_draft():
            if econ.off:
                self.memory.hopeless.add(self.drafter)
            return False
        econ.new_run()
        return True

    @property
    def probe(self) -> bool:
        return self.prompt_pass is not None

    def probed(self) -> None:
        self._probed = True

    def drafted(self, seconds: float) -> None:
        self.economy.drafted(seconds)

    def launched(self, speculative: bool, n_rows: int, seconds: float) -> None:
        """A run was launched; on one stage it was computed inside the launch, in `seconds`."""
        if speculative:
            self.economy.spent(seconds, n_rows)  # every row a drafted token (sync drafting)
        elif n_rows == 1:
            self.economy.single_run(seconds)

    def accepted(self, n: int) -> None:
        self.economy.accepted(n)

    def report(self, runs) -> None:
        """The request's drafting counters (metrics.RunCounts)."""
        runs.drafting_paused = self.economy.pauses
        runs.drafting_ended = self.economy.off


def draft_gate(spec_policy: str, one_local_stage: bool, drafter: Drafter | AsyncDrafter | None, memory: DraftMemory,
               prompt_pass: Callable[[], None] | None = None) -> AlwaysDraft | EconomyGate:
    """The gate for a request: the economy where drafting competes with the target for one
    stage's cores (one stage, drafter on the head, --spec-policy auto), else always.
    drafter: a head-local `Drafter` (its name is what the job remembers) when one_local_stage."""
    if spec_policy == "auto" and one_local_stage:
        return EconomyGate(drafter.name, memory, prompt_pass)
    return AlwaysDraft(prompt_pass)
