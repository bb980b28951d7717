"""Starting the job: detect an external MPI launcher, or re-execute under `mpiexec -n R`."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from ..errors import UsageError, debug_enabled, error_line, illegal_instruction
from .job_output import BannerFilter, LauncherFilter, OutputPump  # noqa: F401 - the filters are part of this module's API
from .process_tree import JobProcesses

# Variables that MPICH/Hydra, Open MPI, Slurm and PMIx set in every rank of a job.
_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "PMI_FD")
RELAUNCHED = "PIPEINFER_RELAUNCHED"
# Signals that stop the job. The job runs in its own session, so the terminal's Ctrl-C reaches
# only this process; it then stops every process of the job itself (see relaunch()).
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def under_mpi_launcher() -> bool:
    if os.environ.get(RELAUNCHED):
        return True
    if any(k in os.environ for k in _MPI_ENV):
        return True
    return "SLURM_STEP_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


# Ranks of this job on this host, as launchers announce them: Hydra, Open MPI, Slurm.
_LOCAL_RANKS_ENV = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def local_rank_count(environ=os.environ) -> int:
    """How many ranks of this job share this host (1 outside a launcher, or when none says)."""
    for key in _LOCAL_RANKS_ENV:
        value = environ.get(key, "").split("(")[0]
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def find_mpiexec() -> str:
    """The mpiexec of the mpich wheel next to this Python, else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise UsageError("no mpiexec found; install the mpich wheel (`pip install mpich`) or a system MPI, or run with --ranks 1")
    return found


def _die_with_parent():
    """A preexec_fn (Linux): mpiexec gets SIGTERM when this process dies, even by SIGKILL, so an
    orphaned job never keeps running. mpiexec tears down its ranks on SIGTERM."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork, called in the child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def child() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return child


def pipeinfer_command(argv: list[str]) -> list[str]:
    """`pipeinfer ARGV` as this very Python runs it: each rank of a job, a child server, a script's job."""
    return [sys.executable, "-m", "pipeinfer_cli", *argv]


def start_own_session(cmd: list[str], **popen_kw) -> subprocess.Popen:
    """Start cmd in a session of its own (a Ctrl-C at the terminal reaches only this process, which
    stops the child itself) that gets SIGTERM when this process dies, even by SIGKILL."""
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent(), **popen_kw)


def run_stoppable(cmd: list[str], **popen_kw) -> tuple[int, int | None]:
    """Run a command that may start an MPI job of its own (an implicit `calibrate --quick`) and wait
    for it: (its exit status, the stop signal this process received meanwhile, or None).

    The child runs in a session of its own that gets SIGTERM if this process dies, even by SIGKILL
    (start_own_session). A Ctrl-C, SIGTERM or SIGHUP that reaches this process is passed on to it
    alone, once, and this process waits until the child has stopped its job (every process of it,
    its shared memory: relaunch()) before it goes on: a stop never leaves the child, or its job,
    running behind the command the user stopped. The status is Popen's (-N: killed by signal N)."""
    got: list[int] = []
    proc: subprocess.Popen | None = None

    def forward(signum, _frame) -> None:
        if got:  # a second Ctrl-C changes nothing: the child is stopping already
            return
        got.append(signum)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in _STOP_SIGNALS}
    try:
        proc = start_own_session(cmd, **popen_kw)
        if got:  # a stop that arrived while it started
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(got[0])
        rc = proc.wait()
    finally:
        _restore_handlers(previous)
    return rc, (got[0] if got else None)


PUMP_DRAIN_S = 10


def relaunch(n_ranks: int, argv: list[str], program: list[str] | None = None) -> int:
    """Run this same command as an MPI job of n_ranks processes and return its exit code.

    The job runs in a session of its own, so a Ctrl-C at the terminal reaches only this process,
    not mpiexec (which would print "Sending Ctrl-C to processes as requested" into the output and
    wait for ranks that may be busy in C code, loading a model). On Ctrl-C, SIGTERM or SIGHUP this
    process stops the job itself: SIGTERM to every process of it, SIGKILL STOP_GRACE_S later,
    and it returns only once they are gone. What the launcher prints about its teardown is
    dropped, and the one line reported is `Error: interrupted` (`Error: stopped by SIGTERM`).

    The head prints its own errors; an abnormal end it could not report (a rank killed or
    crashed) is reported here, in one line. program: what each rank runs before argv, when it is
    not `pipeinfer` (a benchmark script that drives the runtime itself, as scripts/soak.py).
    (`pipeinfer serve` does not use this: its front starts, watches and restarts its job itself,
    transport/supervised_job.py.)
    """
    cmd, env = _job_command(n_ranks, argv, program=program)
    debug = debug_enabled()
    stop = _StopRequest()
    # The handlers come first: a stop that arrives while mpiexec starts stops it right after.
    previous = {s: signal.signal(s, stop.on_signal) for s in _STOP_SIGNALS}
    try:
        proc = start_own_session(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except BaseException:
        _restore_handlers(previous)
        raise
    job = stop.job = JobProcesses(proc)
    pumps = (OutputPump(proc.stdout, sys.stdout.buffer, debug, stop.by_force, stop.stopping),
             OutputPump(proc.stderr, sys.stderr.buffer, debug, stop.by_force, stop.stopping, drop_when_stopping=True))
    exited = threading.Event()
    threading.Thread(target=job.watch_ranks, args=(n_ranks, exited), daemon=True, name="find-ranks").start()
    try:
        if stop.stopping.is_set():
            job.stop()
        job.wait_exited()
    finally:
        exited.set()
        rc = job.finish()
        _restore_handlers(previous)
        # The job's processes are gone, so the pipes reach EOF: wait for what they still hold (the
        # rank's `Error:` line decides below whether to add one) longer than a loaded machine takes
        # to copy it, but not for ever (a stray grandchild could keep a pipe open).
        for pump in pumps:
            pump.join(timeout=PUMP_DRAIN_S)
    return _job_status(rc, pumps, job, stop.signum)


def _job_command(n_ranks: int, argv: list[str], program: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(mpiexec command, environment) of a job of n_ranks running `pipeinfer ARGV` (or program + argv)."""
    mpiexec = find_mpiexec()
    rank_cmd = [*program, *argv] if program else pipeinfer_command(argv)
    return [mpiexec, "-n", str(n_ranks), *rank_cmd], {**os.environ, RELAUNCHED: "1"}


class _StopRequest:
    """A stop signal received by the launching process, and how it stops the job: SIGTERM to every
    process, SIGKILL soon after."""

    def __init__(self):
        self.stopping = threading.Event()
        self.signum: int | None = None
        self.job: JobProcesses | None = None

    def by_force(self) -> None:
        self.stopping.set()  # first, so that the launcher's reaction to the stop is filtered
        if self.job is not None:
            self.job.stop()

    def on_signal(self, signum, _frame) -> None:
        if self.signum is not None:  # a second Ctrl-C changes nothing: the job is being stopped already
            return
        self.signum = signum
        self.by_force()


def _restore_handlers(previous: dict) -> None:
    for s, handler in previous.items():
        signal.signal(s, handler)


def _job_status(rc: int, pumps, job: JobProcesses, stopped_by: int | None) -> int:
    """The relaunching command's exit status once the job is gone (mpiexec's rc), and the one line
    to add when the job could not say what happened itself."""
    if any(pump.broken for pump in pumps):
        return 128 + signal.SIGPIPE  # the reader went away: the job was stopped, nothing to report
    if stopped_by is not None:
        _report("interrupted" if stopped_by == signal.SIGINT else f"stopped by {signal.Signals(stopped_by).name}")
        return 128 + stopped_by
    if rc != 0 and pumps[1].reported:
        # The head printed the error; the launcher may have killed the other ranks since, so its
        # status is the head's only when that is a usage error's 2 (the ranks exit with the head's).
        return 2 if rc == 2 else 1
    if rc != 0:
        # A job that printed nothing of its own never ran: then the launcher's message says why.
        said = [] if any(p.passed for p in pumps) else pumps[1].launcher_messages + pumps[0].launcher_messages
        first = job.first_to_end(pumps[0].failed_pid or pumps[1].failed_pid)
        who = f"rank {first[0]}" if len(first) == 1 else None
        _report(abnormal_end(pumps[0].exit_string or pumps[1].exit_string, rc, said, who))
    return rc


# Launcher messages that only describe the teardown after a rank died (not why it died).
_TEARDOWN = ("assert (!closed)", "terminated badly", "Sending Ctrl-C")


def abnormal_end(reason: str | None, rc: int, launcher_said: list[str] | None = None, who: str | None = None) -> str:
    """What to say when the job ended without an error of its own: from Hydra's exit string, or
    the launcher's first message when it failed to run the job at all (e.g. a host it cannot reach).
    who: the rank whose end brought the job down, when known."""
    said = [m for m in launcher_said or [] if not any(t in m for t in _TEARDOWN)]
    if said and not reason:
        return f"the MPI launcher failed (mpiexec exit status {rc}): {said[0]}"
    how = f"{reason}, " if reason else ""
    if who:
        how = f"{who} ended first; {how}"
    why = killed_why(reason)
    return f"the MPI job ended abnormally ({how}mpiexec exit status {rc}): {why}"


def killed_why(reason: str | None) -> str:
    """Why a rank ended by a signal, from the launcher's exit string ("Killed (signal 9)")."""
    if reason and ("signal 9" in reason or "Killed" in reason):
        return "a rank was killed (SIGKILL), for example by the out-of-memory killer"
    if reason and ("Illegal instruction" in reason or "(signal 4)" in reason):
        return illegal_instruction()
    if reason and ("signal 15" in reason or "Terminated" in reason):
        return ("a rank was stopped (SIGTERM) by someone or something: a scheduler, a `kill`, a shutdown of its "
                "host")
    if reason and ("Segmentation" in reason or "signal 11" in reason or "Aborted" in reason):
        return "a rank crashed; run again with PIPEINFER_DEBUG=1 and report it with the command"
    return ("a rank crashed or was killed (SIGKILL: for example the out-of-memory killer) or stopped (SIGTERM: a "
            "scheduler, a `kill`, a shutdown)")


def _report(msg: str) -> None:
    _say(error_line(msg))


def _say(line: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # the terminal may be gone (SIGHUP)
        sys.stdout.flush()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
