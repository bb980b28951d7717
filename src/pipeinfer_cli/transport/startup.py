"""The job's start-up: every rank checks in with the head at each phase, and nobody spins.

An MPI collective of the mpich wheel busy-waits, and a rank that never arrives leaves the others
in it for ever. So start-up has no collective: at each phase ("start" once the command line is
checked, "loaded" once the models are) every rank sends the head a check-in, an OK with a value
or an error, and the head answers each rank with everyone's values (go) or abort. Waits are
Iprobe + sleep (`Link`), so a waiting rank costs no CPU.

A rank that fails before it reaches the job (a model missing on its node, an option only it
rejects) checks in with its error from the command's error handler (`end_before_start`): the
head reports it once, naming the rank and host, and every rank ends. A rank that never checks in
(it died before MPI started) is reported by the head after PIPEINFER_START_TIMEOUT seconds (ranks
start together and only parse their command line and read GGUF headers before they check in).
"""

from __future__ import annotations

import socket
import sys
import time
from dataclasses import dataclass

from ..errors import PipeinferError
from .messages import Tag
from .faults import FaultInjector
from .mpi_link import Link, WaitPolicy
from .start_waits import started_now

# How long a rank that failed before the start waits for the head's answer before it reports
# the error itself (the head may be slow to reach the start, or gone).
FAILED_RANK_WAIT_S = 15.0


class StartupFailed(PipeinferError):
    """A rank failed (or never arrived) before the job could start; the message names it."""

    def __init__(self, msg: str, exit_code: int = 1):
        super().__init__(msg)
        self.exit_code = exit_code


@dataclass(frozen=True)
class CheckIn:
    """One rank's word at one phase of start-up."""

    phase: str
    host: str
    value: object = None  # what the phase gathers (e.g. thread counts), when ok
    error: str | None = None  # the rank's error message, when it failed
    exit_code: int = 1  # the exit status the error calls for (2: a usage error)


class Startup:
    """This process's start-up exchanges over its Link (one per process: see job_startup)."""

    def __init__(self, link: Link, host: str | None = None):
        self.link = link
        self.host = host or socket.gethostname()
        self.started = False  # the "start" phase is over (later failures use the job's fault protocol)
        self.aborted = False  # the head told every rank that the job will not start
        self.hosts: list[str] = [self.host]
        self.start_values: list = [None]  # every rank's value at the "start" check-in

    # -- every rank --------------------------------------------------------------------------
    def check_in(self, phase: str, value: object = None, error: str | None = None, exit_code: int = 1,
                 deadline_s: float | None = None) -> list:
        """Every rank's value for this phase, on every rank; raises StartupFailed on the head (and
        leaves quietly elsewhere) when any rank checked in with an error."""
        mine = CheckIn(phase, self.host, value, error, exit_code)
        if self.link.size == 1:
            if error is not None:
                raise StartupFailed(error, exit_code)
            if phase == "start":
                self.started, self.start_values = True, [value]
                started_now()
            return [value]
        if self.link.rank == 0:
            values = self._gather(mine, deadline_s)
        else:
            values = self._answer(mine)
        if phase == "start":
            self.start_values = values
        return values

    def _answer(self, mine: CheckIn) -> list:
        """A rank other than the head: check in and take the head's answer."""
        self.link.send_pickled(mine, 0, Tag.STARTUP)
        self.link.flush()
        if mine.error is not None and not self.link.arrives_within(0, Tag.STARTUP, FAILED_RANK_WAIT_S):
            self._report_alone(mine.error, mine.exit_code)  # the head is gone or cut off
        answer = self.link.recv_pickled(0, Tag.STARTUP)
        if answer[0] != "go":
            from .exits import leave_before_start

            leave_before_start(answer[1])  # the head reports the error and ends the job, with this status
        if mine.phase == "start":
            self.started, self.hosts = True, answer[2]
            started_now()
        return answer[1]

    def _report_alone(self, message: str, exit_code: int) -> None:
        from .exits import hard_exit

        print(f"Error: rank {self.link.rank} (host {self.host}): {message}", file=sys.stderr)
        hard_exit(exit_code)

    # -- the head ----------------------------------------------------------------------------
    def _gather(self, mine: CheckIn, deadline_s: float | None) -> list:
        got: dict[int, CheckIn] = {0: mine}
        backoff = self.link.backoff(hi=10e-3)
        t_end = None if deadline_s is None else time.monotonic() + deadline_s
        while len(got) < self.link.size:
            progressed = False
            for r in range(1, self.link.size):
                if r in got:
                    continue
                st = self.link.probe(r, Tag.STARTUP)
                if st is not None:
                    got[r] = self.link.recv_pickled(r, Tag.STARTUP)  # arrived: no wait
                    progressed = True
            if any(c.error is not None for c in got.values()):
                break  # one failure ends the job: no need to wait for the rest
            if progressed:
                backoff.reset()
            elif t_end is not None and time.monotonic() > t_end:
                missing = [r for r in range(self.link.size) if r not in got]
                self._abort()
                raise StartupFailed(
                    f"{_ranks(missing)} did not join the job within {deadline_s:g} s (it may have failed before "
                    "MPI started: see its output above); check that pipeinfer is installed and runs on every host")
            else:
                self.link.progress_sends()
                backoff.idle()
        failed = sorted((r, c) for r, c in got.items() if c.error is not None)
        if failed:
            r, c = failed[0]
            self._abort(c.exit_code)
            where = "" if r == 0 else f"rank {r} (host {c.host}): "
            raise StartupFailed(f"{where}{c.error}", c.exit_code)
        values = [got[r].value for r in range(self.link.size)]
        hosts = [got[r].host for r in range(self.link.size)]
        for r in range(1, self.link.size):
            self.link.send_pickled(("go", values, hosts), r, Tag.STARTUP)
        self.link.flush()
        if mine.phase == "start":
            self.started, self.hosts = True, hosts
            started_now()
        return values

    def _abort(self, exit_code: int = 1) -> None:
        """Tell every rank the job will not start (ranks that have not checked in yet find the
        answer when they do); the head then reports the error and leaves first."""
        from .exits import head_failed

        if self.aborted:
            return
        self.aborted = True
        for r in range(1, self.link.size):
            self.link.send_pickled(("abort", exit_code), r, Tag.STARTUP)
        self.link.flush(timeout_s=2)
        head_failed(exit_code)

    def fail(self, message: str, exit_code: int) -> None:
        """This rank failed before the job started. The head tells every rank to stop and returns
        (its caller prints the error, once for the job). Another rank checks in with the error and
        leaves once the head answered; if the head never does, it prints the error itself (naming
        its rank and host). Only the head returns."""
        if self.link.rank == 0:
            self._abort(exit_code)
            return
        from .exits import leave_before_start

        self.link.send_pickled(CheckIn("start", self.host, None, message, exit_code), 0, Tag.STARTUP)
        self.link.flush(timeout_s=2)
        if self.link.arrives_within(0, Tag.STARTUP, FAILED_RANK_WAIT_S):
            leave_before_start(exit_code)  # the head prints the job's error
        self._report_alone(message, exit_code)


_startup: Startup | None = None


def job_startup() -> Startup:
    """This process's start-up, over the one Link it has to COMM_WORLD (created on first use, with
    the wait policy and the faults the environment asks for: the one place that reads them)."""
    global _startup
    if _startup is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        _startup = Startup(Link(comm, WaitPolicy.from_env(), FaultInjector.from_env(comm.Get_rank())))
    return _startup


def end_before_start(message: str, exit_code: int) -> None:
    """The command's error handler, on any process: if this is a rank of a multi-rank MPI job
    that has not started yet, let the job end as one (see Startup.fail). Returns where the caller
    should print the error: on the head, and outside such a job."""
    from .launch import under_mpi_launcher

    if under_mpi_launcher():
        startup = job_startup()
        if startup.link.size > 1 and not startup.started:
            startup.fail(message, exit_code)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
