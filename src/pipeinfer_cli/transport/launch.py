"""Starting the job: detect an external MPI launcher, or re-execute under `mpiexec -n R`."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from ..errors import UsageError

# Variables that MPICH/Hydra, Open MPI, Slurm and PMIx set in every rank of a job.
_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "PMI_FD")
RELAUNCHED = "PIPEINFER_RELAUNCHED"
# Signals that stop the job: forwarded to mpiexec, which tears down every rank.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_TIMEOUT_S = 10.0  # after forwarding a stop signal, kill mpiexec if it is still there
_PR_SET_PDEATHSIG = 1


def under_mpi_launcher() -> bool:
    if os.environ.get(RELAUNCHED):
        return True
    if any(k in os.environ for k in _MPI_ENV):
        return True
    return "SLURM_STEP_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def find_mpiexec() -> str:
    """The mpiexec of the mpich wheel next to this Python, else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise UsageError("no mpiexec found; install the mpich wheel (`pip install mpich`) or a system MPI, or run with --ranks 1")
    return found


class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


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


def relaunch(n_ranks: int, argv: list[str]) -> int:
    """Run this same command as an MPI job of n_ranks processes and return its exit code.

    Ctrl-C, SIGTERM and SIGHUP are forwarded to mpiexec (which stops every rank); if the job is not
    gone STOP_TIMEOUT_S later, mpiexec is killed. The head prints its own errors; an abnormal end it
    could not report (a rank killed or crashed) is reported here, in one line.
    """
    cmd = [find_mpiexec(), "-n", str(n_ranks), sys.executable, "-m", "pipeinfer_cli", *argv]
    env = {**os.environ, RELAUNCHED: "1"}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, preexec_fn=_die_with_parent())
    errors = _StderrFilter(proc.stderr, keep_banner=bool(os.environ.get("PIPEINFER_DEBUG", "") not in ("", "0")))

    def stop(signum, _frame):
        raise _Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in _STOP_SIGNALS}
    stopped = None
    try:
        try:
            rc = proc.wait()
        except _Stopped as exc:
            stopped = exc.signum
            for s in _STOP_SIGNALS:  # a second Ctrl-C must not interrupt the teardown
                signal.signal(s, signal.SIG_IGN)
            proc.send_signal(signal.SIGINT if stopped == signal.SIGINT else signal.SIGTERM)
            try:
                rc = proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        errors.join(timeout=2)
    if stopped is not None:
        _report("interrupted" if stopped == signal.SIGINT else f"stopped by {signal.Signals(stopped).name}")
        return 128 + stopped
    if rc != 0 and errors.reported:
        return 1  # the head printed the error; the launcher may have killed the other ranks since
    if rc != 0:
        how = f"{errors.exit_string}, " if errors.exit_string else ""
        _report(f"the MPI job ended abnormally ({how}mpiexec exit status {rc}): a rank crashed or was killed, "
                "for example by the out-of-memory killer")
    return rc


class _StderrFilter(threading.Thread):
    """Copies the job's stderr to ours, line by line, and notes whether the head printed an error.

    Hydra prints a multi-line "BAD TERMINATION" banner whenever it kills the remaining ranks of a
    failed job, which is how every failed job ends. The banner is dropped (kept with PIPEINFER_DEBUG):
    either the head already printed the error in one line, or relaunch() reports it in one line.
    """

    _BANNER = re.compile(
        rb"^(=+|=   .*|YOUR APPLICATION TERMINATED WITH THE EXIT STRING: .*|"
        rb"This typically refers to a problem with your application\.|Please see the FAQ page for debugging suggestions)$"
    )
    _EXIT_STRING = re.compile(rb"EXIT STRING: (.*)$")

    def __init__(self, stream, keep_banner: bool):
        super().__init__(daemon=True, name="mpiexec-stderr")
        self.stream, self.keep_banner = stream, keep_banner
        self.reported = False  # a line starting with "Error: " went through
        self.exit_string: str | None = None  # Hydra's reason, e.g. "Killed (signal 9)"
        self.start()

    def run(self) -> None:
        out = sys.stderr.buffer
        blank = False  # a blank line is held back: the banner starts with one
        for line in iter(self.stream.readline, b""):
            body = line.rstrip(b"\r\n")
            if body.startswith(b"Error: "):
                self.reported = True
            if m := self._EXIT_STRING.search(body):
                self.exit_string = m.group(1).decode(errors="replace")
            if not self.keep_banner:
                if not body:
                    blank = True
                    continue
                if self._BANNER.match(body):
                    blank = False
                    continue
                if blank:
                    out.write(b"\n")
                    blank = False
            out.write(line)
            out.flush()
        if blank:
            out.write(b"\n")
            out.flush()


def _report(msg: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(f"Error: {msg}\n")
    sys.stderr.flush()
