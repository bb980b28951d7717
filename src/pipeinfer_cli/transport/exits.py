"""How a rank of a failed job leaves, so that the error is printed once and no process hangs.

MPI launchers (Hydra, Open MPI) kill the whole job as soon as one process exits without
MPI_Finalize. So the other ranks wait for the head to leave first (at most ABORT_GRACE_S), and
the head leaves without finalizing only after the error has been printed: the message cannot be
lost, and the launcher tears the job down at once.
"""

from __future__ import annotations

import atexit
import os
import sys
import time

ABORT_GRACE_S = 3.0  # a rank told to abort waits this long for the head to print the error and leave
# Before the job starts the head is known to be alive (it just answered), so a rank waits longer
# for it: a rank that leaves by itself at the moment the launcher kills it can be reported as
# killed (Hydra's status 9 instead of a usage error's 2), which a loaded machine made happen.
START_ABORT_GRACE_S = 10.0


def hard_exit(code: int) -> None:
    """Leave without MPI_Finalize, which could wait forever on a dead peer."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_after_head(code: int = 1, grace_s: float = ABORT_GRACE_S) -> None:
    """A non-head rank of a failed job: let the head leave first, then exit without MPI_Finalize.

    The head prints the error and exits; the launcher then kills this process. If the head cannot
    (it is stuck or dead), leave after grace_s: the launcher then ends the job."""
    time.sleep(grace_s)
    hard_exit(code)


def leave_before_start(code: int) -> None:
    """A non-head rank of a job that failed before it started: leave_after_head with the longer
    start-up grace (START_ABORT_GRACE_S: the head has just answered, so it is alive)."""
    leave_after_head(code, START_ABORT_GRACE_S)


def head_failed(code: int = 1) -> None:
    """The head of a failed multi-rank job: once the error is reported (at interpreter exit), leave
    without MPI_Finalize, so that the launcher stops the ranks waiting in leave_after_head at once."""
    atexit.register(hard_exit, code)
