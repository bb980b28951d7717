"""What every non-head rank shares with the head about a request: its per-request report, the
abort signal, and the debug fault injection (stages, draft rank and head alike)."""

from __future__ import annotations

import time

from ..transport.mpi_link import Link, WaitPolicy
from ..decode.metrics import peak_rss_mib, process_stats


class JobAborted(Exception):
    """The head told this rank to stop because the job failed elsewhere."""


def fault_injection(link: Link | None) -> int | None:
    """Where this rank raises on purpose, as its link's fault injector plans it
    (PIPEINFER_DEBUG_FAULT=RANK:raise:N, transport/faults.py): on its N-th run (a stage), draft proposal
    (the draft rank) or committed token (the head, rank 0), to test fault handling. None: never."""
    faults = link.faults if link is not None else None
    return faults.raise_at if faults is not None else None


class RankReport:
    """One rank's counters for the current request, sent to (or kept by) the head at each REPORT.

    Every count restarts at each report, so a report is exactly one request's share. cpu_s counts
    CPU seconds since the previous report, so an idle rank that spins would show it."""

    def __init__(self, rank: int, role: str, layers, threads: int, trace, engine=None, link: Link | None = None,
                 weights: dict | None = None):
        self.rank, self.role, self.layers, self.threads = rank, role, layers, threads
        self.weights = weights  # where the rank's weights came from, once per job (runtime/weight_stream.py)
        self.trace, self.engine, self.link = trace, engine, link
        self.busy_s = 0.0  # seconds computing (stage evals, draft proposals)
        self.runs = 0  # runs computed or draft requests answered
        self.kv_at_start: int | None = None  # KV cells in use when this request began (after the last clear)
        self._reset()

    def _reset(self) -> None:
        self.busy_s, self.runs, self.kv_at_start = 0.0, 0, None
        self._cpu0 = time.process_time()
        self._engine0 = dict(self.engine.stats()) if self.engine is not None else None
        if self.link is not None:
            self.link.traffic.take()

    def take(self, **extra) -> dict:
        """The report since the previous one (trace events included); counting starts again."""
        events = list(self.trace.events)
        self.trace.events.clear()
        out = {"rank": self.rank, "role": self.role, "layers": self.layers, "threads": self.threads,
               "peak_rss_mib": round(peak_rss_mib(), 1), "busy_s": round(self.busy_s, 4),
               "cpu_s": round(time.process_time() - self._cpu0, 3), "runs": self.runs, "wait": self._wait_style()}
        out["process"] = process_stats()
        if self.weights is not None:
            out["weights"] = self.weights
        if self.engine is not None:
            stats = dict(self.engine.stats())
            out["engine"] = {k: v - self._engine0.get(k, 0) for k, v in stats.items()}
            out["kv_used_cells"] = self.engine.kv_used_cells()
            out["kv_used_cells_at_start"] = self.kv_at_start
            out["kv_min_resume"] = self.engine.kv_min_resume(0)  # the canonical sequence (window cache)
        if self.link is not None:
            out["wire"] = self.link.traffic.take()
        out.update(extra)
        out["trace"] = events
        self._reset()
        return out

    def _wait_style(self) -> str:
        """How this rank waits for messages (its link's wait policy; the environment's without a link)."""
        return (self.link.wait_policy if self.link is not None else WaitPolicy.from_env()).style()
