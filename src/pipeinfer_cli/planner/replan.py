"""When `-M auto` plans again between requests: the acceptance it planned on against the one measured.

A job started with `-M auto` chose its settings on an acceptance measured ahead (the prompt, the
profile) or assumed. After each request the job adds that request's drafted and accepted tokens to a
running total; when the total's rate leaves the rate planned on by more than REPLAN_MARGIN, over at
least REPLAN_MIN_DRAFTED drafted tokens (one short answer must not flip the plan), the planner's
search runs again at the measured rate and the following requests use its settings. The mode stays:
the job's ranks were started for it. Settings never change tokens (every mode is lossless).
"""

from __future__ import annotations

from dataclasses import dataclass

REPLAN_MARGIN = 0.15  # absolute: 0.60 planned, 0.82 measured -> plan again
REPLAN_MIN_DRAFTED = 16  # drafted tokens, over the requests so far, before a measured rate counts


@dataclass
class MeasuredAcceptance:
    """The running total of a job's requests: draft tokens verified, and accepted."""

    planned: float  # the rate the current settings were chosen on
    drafted: int = 0
    accepted: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted

    @property
    def rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def should_replan(self) -> bool:
        """True when the measured rate left the planned one by the margin, over enough drafted tokens."""
        return (self.drafted >= REPLAN_MIN_DRAFTED and self.rate is not None
                and abs(self.rate - self.planned) > REPLAN_MARGIN)

    def replanned(self) -> None:
        """The settings are now planned on the measured rate."""
        self.planned = self.rate
