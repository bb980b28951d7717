"""When `-M auto` plans again between requests: the acceptance it planned on against the one measured.

A job started with `-M auto` chose its settings on an acceptance measured ahead (the prompt, the
profile) or assumed. After each request the job adds that request's drafted and accepted tokens to a
running total; when the total's rate leaves the rate planned on by more than REPLAN_MARGIN, over at
least REPLAN_MIN_DRAFTED drafted tokens (one short answer must not flip the plan), the planner's
search runs again at the measured rate and the following requests use its settings. The mode stays:
the job's ranks were started for it. Settings never change tokens (every mode is lossless).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .acceptance import DEFAULT_ACCEPTANCE

if TYPE_CHECKING:
    from ..decode.session import DecodeOptions
    from .auto_choice import AutoChoice
    from .job_config import JobConfig

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


def replan_settings(cfg: JobConfig, mode: str, n_ranks: int, rate: float,
                    max_inflight_cap: int | None = None) -> tuple[DecodeOptions, float | None]:
    """The planner's best settings for `mode` (the job's: its ranks were started for it) at `rate`;
    max_inflight_cap: the runs in flight the started job's KV sequences hold (search.candidate_options)."""
    from . import search
    from .job_placement import job_placements, job_threads
    from .layout import parse_threads
    from .plan import Replay
    from .profile import Profile

    prof = Profile.load(cfg.profile)
    n_gen = cfg.decode.n_predict if 0 < cfg.decode.n_predict < search.AUTO_GEN else search.AUTO_GEN
    replay = Replay([search.auto_request(None, n_gen)], rate)
    # The job's own placement (the one chosen at its start is its --layer-split now) at its threads.
    threads = [parse_threads(cfg.threads, n_ranks) if cfg.threads else job_threads(prof, mode, None, n_ranks)]
    p = job_placements(cfg, prof, n_ranks, mode, replay, threads=threads)[0]
    best = search.search_settings(p.profile, p.topo, mode, replay, cfg.decode, cfg.n_ctx,
                                  max_inflight_cap=max_inflight_cap)
    return best.opts, best.tok_per_s


class Replanner:
    """-M auto between the requests of a job: the settings the next request runs with (decode),
    planned again when the measured acceptance leaves the planned one (planner/replan.py)."""

    def __init__(self, cfg: JobConfig, choice: AutoChoice, n_ranks: int, say) -> None:
        self.cfg, self.choice, self.n_ranks, self.say = cfg, choice, n_ranks, say
        self.decode = choice.decode
        self._lock = threading.Lock()  # serve: one re-count at a time (after_in_background)
        rate = choice.acceptance.rate
        self.measured = MeasuredAcceptance(DEFAULT_ACCEPTANCE if rate is None else rate)

    def after_in_background(self, drafted: int, accepted: int) -> None:
        """serve: count a finished request; plan again on a thread of its own, so that the pipeline
        goes on with the current settings meanwhile (requests are counted in the order they end)."""
        def count() -> None:
            with self._lock:
                self.after(drafted, accepted)

        threading.Thread(target=count, daemon=True, name="pipeinfer-replan").start()

    def after(self, drafted: int, accepted: int) -> None:
        """Count a finished request's acceptance; plan again (and say so) when it left the plan's."""
        from ..decode.modes import needs_draft

        self.measured.add(drafted, accepted)
        if not needs_draft(self.choice.mode) or not self.measured.should_replan():
            return
        m = self.measured
        before = m.planned
        # The job's KV sequences were opened for the first choice's runs in flight: no more fit.
        self.decode, speed = replan_settings(self.cfg, self.choice.mode, self.n_ranks, m.rate,
                                             max_inflight_cap=self.choice.decode.max_inflight)
        m.replanned()
        d = self.decode
        knobs = f"--n-draft {d.n_draft}" + (f" -pa {d.p_accept} --max-inflight {d.max_inflight}"
                                            if self.choice.mode == "pipeinfer" else "")
        pred = "" if speed is None else f" (predicted {speed:.2f} tok/s)"
        self.say(f"pipeinfer: -M auto: measured acceptance {m.rate:.2f} over {m.drafted} drafted tokens "
                 f"(assumed {before:.2f}): re-planned {knobs}{pred}")


def hindsight(cfg: JobConfig, choice: AutoChoice, n_ranks: int, drafted: int, accepted: int) -> str | None:
    """After generate's one request: when its acceptance left the one planned on by the margin
    (planner/replan.py), what the plan at the measured rate would have chosen; else None."""
    from ..decode.modes import needs_draft
    planned = DEFAULT_ACCEPTANCE if choice.acceptance.rate is None else choice.acceptance.rate
    m = MeasuredAcceptance(planned)
    m.add(drafted, accepted)
    if not needs_draft(choice.mode) or not m.should_replan() or cfg.profile is None:
        return None
    d, speed = replan_settings(cfg, choice.mode, n_ranks, m.rate)
    pred = "" if speed is None else f", predicted {speed:.2f} tok/s"
    return (f"pipeinfer: -M auto: measured acceptance {m.rate:.2f} over {drafted} drafted tokens (planned on "
            f"{planned:.2f}): at that rate the plan picks n_draft {d.n_draft}, p_accept {d.p_accept}, max_inflight "
            f"{d.max_inflight}{pred}; `pipeinfer calibrate --draft` measures a draft's acceptance ahead")
