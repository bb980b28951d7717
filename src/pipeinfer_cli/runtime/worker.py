"""Every rank's part in the job's fault protocol, and which role a non-head rank serves.

Fault handling: any rank that fails tells the head (ERROR); the head reports the error once and
tells every rank to stop (ABORT); every process then exits with status 1 within seconds, so an
`mpiexec` never hangs on a dead job. Who leaves first, and how, is transport/exits.py; failures
before the job starts go through transport/startup.py.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import describe, error_line
from ..transport.exits import hard_exit, head_failed, leave_after_head
from ..transport.liveness import HeadUnresponsiveError
from ..transport.messages import Tag
from ..transport.mpi_link import Link
from .rank_report import JobAborted

if TYPE_CHECKING:
    from ..decode.trace import TraceRecorder
    from .loaded import Loaded

ERROR_WAIT_S = 5.0  # a failed rank waits this long for the head's ABORT before leaving anyway


def fail_after_error(link: Link, exc: BaseException, debug: bool) -> None:
    """A worker rank that raised: report to the head, wait (briefly) for its ABORT, and leave.

    If the head never answers (it is dead or stuck, or the report was lost), print the error here,
    so that it is not lost with the job."""
    text = describe(exc, traceback_too=debug)
    if link.liveness is not None:
        link.liveness.stop()  # the head decides now; a silent head is caught by the deadline below
    link.report_error(text)
    link.flush(timeout_s=2)
    if link.arrives_within(0, Tag.ABORT, ERROR_WAIT_S):
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


def abort_job(link: Link) -> None:
    """The head of a failed multi-rank job: stop every other rank now; leave once the error is printed."""
    head_failed()
    link.abort_all()


def serve_worker(link: Link, loaded: Loaded, debug: bool, trace: TraceRecorder,
                 before: Callable[[], object] | None = None) -> None:
    """A non-head rank: serve the pipeline (a stage) or draft requests (the draft rank) until the
    head shuts the job down; on failure, report to the head and leave (see the module doc)."""
    from .remote_draft import serve_draft
    from .stage import serve_stage

    try:
        if before is not None:  # the clock probes at start, inside the fault protocol
            before()
        if loaded.me.role == "draft":
            serve_draft(link, loaded.drafter, loaded.me.threads, trace, loaded.weights)
        else:
            serve_stage(link, loaded.engine, loaded.me.threads, trace, loaded.weights)
        link.flush()
        link.drop_unreceived()  # the head sends nothing after SHUTDOWN: what is left can only be stale
    except JobAborted:
        leave_after_head(1)
    except HeadUnresponsiveError as exc:
        end_without_head(link, exc)
    except Exception as exc:  # noqa: BLE001 - reported to the head, which prints it once
        fail_after_error(link, exc, debug)
