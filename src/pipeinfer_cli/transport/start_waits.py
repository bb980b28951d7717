"""Start-up waits that sleep: settings a rank applies before MPI starts (no MPI import here)."""

from __future__ import annotations

import os
import sys

# MPICH's MPI_Init waits for every rank of the host with a sched_yield loop: a full core for as
# long as another rank is late to start (its host is slow, or it failed before MPI). Two settings
# make that wait sleep instead, for start-up only: MPICH's heavy yield (a nanosleep in the loop)
# and a 1 ms timer slack on the main thread (the nanosleep then lasts about that long, not 50 us).
# The slack goes back to its default once the job has started, before any compute thread exists:
# the pipeline's own waits sleep for tens of microseconds.
HEAVY_YIELD_ENV = "MPIR_CVAR_ENABLE_HEAVY_YIELD"
START_TIMER_SLACK_NS = 1_000_000
_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30
_saved_slack: int | None = None


def sleep_while_starting() -> None:
    """Before MPI starts in a rank: make MPICH's start-up waits sleep (see above)."""
    global _saved_slack
    os.environ.setdefault(HEAVY_YIELD_ENV, "1")
    libc = _libc()
    if libc is not None and _saved_slack is None:
        _saved_slack = libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
        libc.prctl(_PR_SET_TIMERSLACK, START_TIMER_SLACK_NS, 0, 0, 0)


def started_now() -> None:
    """Start-up is over: the main thread's timers are precise again, and the watchdog leaves."""
    global _saved_slack
    disarm_start_watchdog()
    libc = _libc()
    if libc is not None and _saved_slack is not None and _saved_slack > 0:
        libc.prctl(_PR_SET_TIMERSLACK, _saved_slack, 0, 0, 0)
    _saved_slack = None


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


# A rank that dies before MPI starts (pipeinfer missing on its host, a crash at import) never joins
# MPI_Init, and MPICH's launcher then waits for ever with every other rank inside MPI_Init, which
# holds the GIL: no Python thread can time it out. A forked watchdog process can: it ends this
# rank if the job has not started (started_now) within PIPEINFER_START_TIMEOUT + WATCHDOG_EXTRA_S. Rank 0 says why; the
# others wait a little longer, in case rank 0 itself is the one that never started.
START_TIMEOUT_ENV = "PIPEINFER_START_TIMEOUT"
DEFAULT_START_TIMEOUT_S = 120.0
WATCHDOG_EXTRA_S = 15.0  # after the head's own deadline for the ranks' check-ins (startup.py), which names them
OTHER_RANKS_EXTRA_S = 10.0
_RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
_watchdog_fd: int | None = None
_watchdog_pid: int | None = None
WATCHDOG_NAME = b"pipeinfer-start"  # the watchdog's process name: not a rank (process_tree.py)
_PR_SET_NAME = 15


def launcher_rank(environ=os.environ) -> int:
    """This process's rank as the launcher announced it (0 when none says)."""
    for key in _RANK_ENV:
        if environ.get(key, "").isdigit():
            return int(environ[key])
    return 0


def launcher_size(environ=os.environ) -> int | None:
    """The job's rank count as the launcher announced it (MPICH/Hydra, Open MPI, srun), or None."""
    for key in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if environ.get(key, "").isdigit():
            return int(environ[key])
    if "SLURM_STEP_ID" in environ and environ.get("SLURM_NTASKS", "").isdigit():
        return int(environ["SLURM_NTASKS"])
    return None


def start_timeout_s(environ=os.environ) -> float:
    """How long every rank of a job has to start and check in: PIPEINFER_START_TIMEOUT seconds."""
    text = environ.get(START_TIMEOUT_ENV, "")
    try:
        value = float(text) if text else DEFAULT_START_TIMEOUT_S
    except ValueError:
        value = DEFAULT_START_TIMEOUT_S
    return value if value > 0 else DEFAULT_START_TIMEOUT_S


def arm_start_watchdog() -> None:
    """Fork the watchdog (before MPI starts: a fork after MPI_Init is unsafe)."""
    global _watchdog_fd, _watchdog_pid
    if _watchdog_fd is not None or not hasattr(os, "fork"):
        return
    rank = launcher_rank()
    wait_s = start_timeout_s() + WATCHDOG_EXTRA_S + (OTHER_RANKS_EXTRA_S if rank else 0.0)
    read_end, write_end = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the watchdog: no Python-level cleanup of the parent's state, ever
        try:
            os.close(write_end)
            libc = _libc()
            if libc is not None:
                libc.prctl(_PR_SET_NAME, WATCHDOG_NAME, 0, 0, 0)
            import select

            ready, _, _ = select.select([read_end], [], [], wait_s)
            if not ready:  # neither started nor ended: MPI never started on some rank
                import signal
                import socket

                who = f"rank {rank} (host {socket.gethostname()}): " if rank else ""
                msg = (f"Error: {who}the MPI job did not start within {wait_s:g} s: a rank failed before MPI "
                       "started (see its output above) or never started; check that pipeinfer runs on every host")
                os.write(2, (msg + "\n").encode())
                os.kill(parent, signal.SIGKILL)
        finally:
            os._exit(0)
    os.close(read_end)
    _watchdog_fd, _watchdog_pid = write_end, pid


WATCHDOG_REAP_S = 5.0


def disarm_start_watchdog() -> None:
    """The watchdog leaves, and is reaped (else it stays a zombie under the rank for the job's life)."""
    global _watchdog_fd, _watchdog_pid
    if _watchdog_fd is not None:
        os.close(_watchdog_fd)  # the watchdog sees end of file and leaves
        _watchdog_fd = None
    if _watchdog_pid is not None:
        pid, _watchdog_pid = _watchdog_pid, None
        _reap(pid, WATCHDOG_REAP_S)


def _reap(pid: int, timeout_s: float) -> None:
    """Wait for the child pid to exit (it leaves at once on end of file), polling, at most timeout_s."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped already (a SIGCHLD handler), or not our child
            return
        if done or time.monotonic() >= deadline:
            return
        time.sleep(0.002)
