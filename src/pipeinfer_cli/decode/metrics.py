"""Generation metrics, with the field names of the JSON output (docs/json-output.md)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np


def now() -> float:
    return time.perf_counter()


@dataclass
class ProcessStats:
    """This process at one moment (Linux /proc; None where unknown): resident MiB, open file
    descriptors, OS threads and Python threads."""

    rss_mib: float | None = None
    fds: int | None = None
    threads: int | None = None
    py_threads: int = 0

    def as_dict(self) -> dict:
        return {"rss_mib": self.rss_mib, "fds": self.fds, "threads": self.threads, "py_threads": self.py_threads}


def process_stats() -> ProcessStats:
    """This process now. Reported after every request, so that leaks show (the soak)."""
    out = ProcessStats(py_threads=threading.active_count())
    try:
        with open("/proc/self/statm") as f:
            out.rss_mib = round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
        out.fds = len(os.listdir("/proc/self/fd"))
        out.threads = len(os.listdir("/proc/self/task"))
    except (OSError, ValueError, IndexError):
        pass
    return out


@dataclass
class RunCounters:
    launched: int = 0
    speculative: int = 0
    cancelled: int = 0  # runs the head cancelled (before or during compute on some stage)
    cancelled_at_end: int = 0  # of which: still in flight when generation stopped (not rejections)
    cancelled_mid_compute: int = 0  # summed over stages: evals aborted between/inside layers
    layer_evals_skipped: int = 0  # summed over stages: layers not computed thanks to cancellation
    branches_launched: int = 0  # token trees (pipeinfer): side branches launched (sequences beyond a run's first)
    branches_cancelled: int = 0  # token trees: branches dropped early while their run stayed useful
    drafting_paused: int = 0  # pipeinfer on one stage: times drafting stopped because it did not pay
    drafting_ended: bool = False  # pipeinfer on one stage: this draft cannot pay here (found by this request or an earlier one of the job)


@dataclass
class Acceptance:
    drafted: int = 0  # draft tokens whose verification completed
    accepted: int = 0
    verified_runs: int = 0
    # Hybrid drafting (--draft lookup+MODEL, suffix+MODEL): [drafted, accepted] per source
    # ("lookup" or "suffix", and "model").
    by_source: dict[str, list[int]] = field(default_factory=dict)

    def add(self, drafted: int, accepted: int, source: str | None = None) -> None:
        """Count verified draft tokens, and under their source when the drafter names one."""
        self.drafted += drafted
        self.accepted += accepted
        if source is not None:
            row = self.by_source.setdefault(source, [0, 0])
            row[0] += drafted
            row[1] += accepted

    @property
    def rate(self) -> float | None:
        """accepted / drafted; None when nothing was drafted."""
        return (self.accepted / self.drafted) if self.drafted else None

    @property
    def mean_accepted_len(self) -> float | None:
        """Draft tokens accepted per verified run; None before any run was verified."""
        return (self.accepted / self.verified_runs) if self.verified_runs else None

    def to_dict(self) -> dict:
        out = {"drafted": self.drafted, "accepted": self.accepted, "rate": self.rate,
               "mean_accepted_len": self.mean_accepted_len}
        if self.by_source:
            out["by_source"] = {k: {"drafted": d, "accepted": a, "rate": a / d if d else None}
                                for k, (d, a) in sorted(self.by_source.items())}
        return out


@dataclass
class DraftWork:
    """What the drafter did for a request, in target tokens, whatever became of it (docs/json-output.md, `drafting`)."""

    proposed: int = 0  # tokens the drafter proposed: launched, cut by the confidence threshold, or dropped (a stale reply)
    launched: int = 0  # of which sent down the pipeline as rows of speculative runs (side branches included)

    def to_dict(self, n_gen: int) -> dict:
        return {"proposed": self.proposed, "launched": self.launched,
                "proposed_per_committed": self.proposed / n_gen if n_gen else None,
                "launched_per_committed": self.launched / n_gen if n_gen else None}


@dataclass
class GenerationMetrics:
    n_prompt: int = 0
    t_start: float = 0.0  # start of prompt processing (models loaded)
    token_times: list[float] = field(default_factory=list)  # head clock when each token was committed
    acceptance: Acceptance = field(default_factory=Acceptance)
    runs: RunCounters = field(default_factory=RunCounters)
    drafting: DraftWork = field(default_factory=DraftWork)

    def committed(self, n: int, t: float) -> None:
        self.token_times.extend([t] * n)

    def rates(self) -> "Rates":
        """Counts and speeds from the commit times (docs/json-output.md defines each)."""
        n_gen = len(self.token_times)
        if not n_gen:
            return Rates(self.n_prompt, 0, None, None, None, None)
        t_first, t_last = self.token_times[0], self.token_times[-1]
        # Inter-token latency as the user sees tokens arrive: tokens committed together (an
        # accepted speculative run) arrive at once, so the gaps are between arrivals, not the
        # zero gaps inside one burst, which would make the median meaningless.
        gaps = np.diff(np.unique(np.asarray(self.token_times))) * 1e3
        return Rates(
            self.n_prompt, n_gen, ttft_s=t_first - self.t_start,
            tok_per_s=n_gen / (t_last - self.t_start) if t_last > self.t_start else None,
            decode_tok_per_s=(n_gen - 1) / (t_last - t_first) if n_gen > 1 and t_last > t_first else None,
            itl_ms=({"mean": float(gaps.mean()), "p50": float(np.percentile(gaps, 50)),
                     "p90": float(np.percentile(gaps, 90))} if len(gaps) else None))

    def to_dict(self) -> dict:
        return {**vars(self.rates()), "acceptance": self.acceptance.to_dict(), "runs": vars(self.runs).copy()}


@dataclass
class Rates:
    """A request's counts and speeds, as `GenerationMetrics.rates` computes them."""

    n_prompt: int  # prompt tokens
    n_gen: int  # generated tokens
    ttft_s: float | None  # start of prompt processing -> first token known at the head; None without tokens
    tok_per_s: float | None  # n_gen / (t_last_token - t_start)
    decode_tok_per_s: float | None  # (n_gen - 1) / (t_last_token - t_first_token); None under two tokens
    itl_ms: dict | None  # {"mean", "p50", "p90"} of the gaps between token arrivals; None under two arrivals
