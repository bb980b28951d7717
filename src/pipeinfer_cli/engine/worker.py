"""Every rank's part in the job's fault protocol, and the per-request report a rank sends the head.

Fault handling: any rank that fails tells the head (ERROR); the head reports the error once and
tells every rank to stop (ABORT); every process then exits with status 1 within seconds, so an
`mpiexec` never hangs on a dead job. Who leaves first, and how, is transport/exits.py; failures
before the job starts go through transport/startup.py.
"""

from __future__ import annotations

import os
import sys
import time

from ..errors import describe, error_line
from ..transport.exits import hard_exit, head_failed, leave_after_head
from ..transport.liveness import HeadUnresponsiveError
from ..transport.mpi_link import Backoff, Link, wait_style
from .metrics import peak_rss_mib, process_stats

ERROR_WAIT_S = 5.0  # a failed rank waits this long for the head's ABORT before leaving anyway
FAIL_ENV = "PIPEINFER_DEBUG_FAIL"


class JobAborted(Exception):
    """The head told this rank to stop because the job failed elsewhere."""


def fail_after_error(link: Link, exc: BaseException, debug: bool) -> None:
    """A worker rank that raised: report to the head, wait (briefly) for its ABORT, and leave.

    If the head never answers (it is dead or stuck, or the report was lost), print the error here,
    so that it is not lost with the job."""
    text = describe(exc, traceback_too=debug)
    if link.liveness is not None:
        link.liveness.stop()  # the head decides now; a silent head is caught by the deadline below
    link.report_error(text)
    link.flush(timeout_s=2)
    deadline = time.monotonic() + ERROR_WAIT_S
    backoff = Backoff(hi=10e-3)
    while time.monotonic() < deadline and not link.abort_requested():
        backoff.idle()
    if link.abort_requested():
        leave_after_head(1)
    print(error_line(f"rank {link.rank}: {text}"), file=sys.stderr)
    hard_exit(1)


def end_without_head(link: Link, exc: HeadUnresponsiveError) -> None:
    """The head stopped answering: rank 1 says so (once for the job) and leaves; the others leave a
    moment later, so that the launcher does not stop rank 1 before it has printed."""
    if link.rank == 1:
        print(error_line(str(exc)), file=sys.stderr)
        hard_exit(1)
    leave_after_head(1)


def fault_injection(rank: int) -> int | None:
    """PIPEINFER_DEBUG_FAIL=RANK:N makes rank RANK raise on its N-th run (a stage), draft proposal (the
    draft rank) or committed token (the head, rank 0), to test fault handling."""
    spec = os.environ.get(FAIL_ENV, "")
    if not spec:
        return None
    r, _, n = spec.partition(":")
    return int(n or 1) if int(r) == rank else None


class RankReport:
    """One rank's counters for the current request, sent to (or kept by) the head at each REPORT.

    Every count restarts at each report, so a report is exactly one request's share. cpu_s counts
    CPU seconds since the previous report, so an idle rank that spins would show it."""

    def __init__(self, rank: int, role: str, layers, threads: int, trace, engine=None, link: Link | None = None):
        self.rank, self.role, self.layers, self.threads = rank, role, layers, threads
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
               "cpu_s": round(time.process_time() - self._cpu0, 3), "runs": self.runs, "wait": wait_style()}
        out["process"] = process_stats()
        if self.engine is not None:
            stats = dict(self.engine.stats())
            out["engine"] = {k: v - self._engine0.get(k, 0) for k, v in stats.items()}
            out["kv_used_cells"] = self.engine.kv_used_cells()
            out["kv_used_cells_at_start"] = self.kv_at_start
        if self.link is not None:
            out["wire"] = self.link.traffic.take()
        out.update(extra)
        out["trace"] = events
        self._reset()
        return out


def abort_job(link: Link) -> None:
    """The head of a failed multi-rank job: stop every other rank now; leave once the error is printed."""
    head_failed()
    link.abort_all()


def serve_worker(link: Link, loaded, debug: bool, trace, before=None) -> None:
    """A non-head rank: serve the pipeline (a stage) or draft requests (the draft rank) until the
    head shuts the job down; on failure, report to the head and leave (see the module doc)."""
    from .remote_draft import serve_draft
    from .stage import serve_stage

    try:
        if before is not None:  # the clock probes at start, inside the fault protocol
            before()
        if loaded.me.role == "draft":
            serve_draft(link, loaded.drafter, loaded.me.threads, trace)
        else:
            serve_stage(link, loaded.engine, loaded.me.threads, trace)
        link.flush()
        link.drop_unreceived()  # the head sends nothing after SHUTDOWN: what is left can only be stale
    except JobAborted:
        leave_after_head(1)
    except HeadUnresponsiveError as exc:
        end_without_head(link, exc)
    except Exception as exc:  # noqa: BLE001 - reported to the head, which prints it once
        fail_after_error(link, exc, debug)
