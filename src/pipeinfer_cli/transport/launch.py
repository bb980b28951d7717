"""Starting the job: detect an external MPI launcher, or re-execute under `mpiexec -n R`."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
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
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_die_with_parent())
    keep_banner = os.environ.get("PIPEINFER_DEBUG", "") not in ("", "0")

    def stop_job() -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)

    pumps = (_Pump(proc.stdout, sys.stdout.buffer, keep_banner, stop_job),
             _Pump(proc.stderr, sys.stderr.buffer, keep_banner, stop_job))

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
        for pump in pumps:
            pump.join(timeout=2)
    if any(pump.broken for pump in pumps):
        return 128 + signal.SIGPIPE  # the reader went away: the job was stopped, nothing to report
    if stopped is not None:
        _report("interrupted" if stopped == signal.SIGINT else f"stopped by {signal.Signals(stopped).name}")
        return 128 + stopped
    if rc != 0 and pumps[1].reported:
        return 1  # the head printed the error; the launcher may have killed the other ranks since
    if rc != 0:
        reason = pumps[0].exit_string or pumps[1].exit_string
        how = f"{reason}, " if reason else ""
        _report(f"the MPI job ended abnormally ({how}mpiexec exit status {rc}): a rank crashed or was killed, "
                "for example by the out-of-memory killer")
    return rc


class BannerFilter:
    """Removes Hydra's "BAD TERMINATION" banner from a byte stream, passing everything else through
    as soon as it arrives (generated text streams without newlines, so it is not line-buffered).

    Hydra prints the banner on its stdout whenever it kills the remaining ranks of a failed job,
    which is how a failed job ends. Either the head already printed the error in one line, or
    relaunch() reports it in one line, so the banner is noise. Only the exact banner is removed: a
    rule of '=' followed by its title line, up to its closing "Please see the FAQ…" line. Blank
    lines and '=' rules are held back until the next line shows whether they open a banner.
    """

    _RULE_MIN = 20
    _TITLE = b"=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES"
    _LAST = b"Please see the FAQ page for debugging suggestions"
    _EXIT_STRING = b"YOUR APPLICATION TERMINATED WITH THE EXIT STRING: "

    def __init__(self):
        self.partial = b""  # bytes of the current line not yet passed through
        self.held: list[bytes] = []  # complete lines held back (blank lines, then maybe one rule)
        self.in_banner = False
        self.line_start = True  # nothing of the current line was passed through yet
        self.exit_string: str | None = None  # Hydra's reason, e.g. "Killed (signal 9)"
        self.lines: list[bytes] = []  # complete lines passed through (for error detection)

    @classmethod
    def _is_rule(cls, line: bytes) -> bool:
        return len(line) >= cls._RULE_MIN and line.strip(b"=") == b""

    def _holding_rule(self) -> bool:
        return bool(self.held) and self._is_rule(self.held[-1].rstrip(b"\r\n"))

    def _may_hold(self, part: bytes) -> bool:
        """Could this start of a line still be part of a banner?"""
        if self.in_banner:
            return True
        if self._holding_rule():
            return self._TITLE.startswith(part)
        return part.strip(b"=") == b""

    def _release(self, out: list[bytes]) -> None:
        out.extend(self.held)
        self.held.clear()

    def _line(self, raw: bytes, out: list[bytes]) -> None:
        """A complete line (with its newline) that starts at a line start."""
        line = raw.rstrip(b"\r\n")
        if self.in_banner:
            if line.startswith(self._EXIT_STRING):
                self.exit_string = line[len(self._EXIT_STRING):].decode(errors="replace")
            self.in_banner = line != self._LAST
            return
        if self._holding_rule() and line == self._TITLE:
            self.held.clear()  # the banner's rule and the blank lines before it
            self.in_banner = True
            return
        if line == b"" and not self._holding_rule():
            self.held.append(raw)
            return
        if self._is_rule(line):
            if self._holding_rule():
                out.append(self.held.pop())  # two rules in a row: the first is text
            self.held.append(raw)
            return
        self._release(out)
        out.append(raw)
        self.lines.append(line)

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        i = 0
        while i < len(data):
            nl = data.find(b"\n", i)
            if not self.line_start:  # inside a line already passed through
                end = len(data) if nl < 0 else nl + 1
                out.append(data[i:end])
                self.line_start = nl >= 0
                i = end
                continue
            if nl < 0:  # the rest is an incomplete line
                self.partial += data[i:]
                if not self._may_hold(self.partial):
                    self._release(out)
                    out.append(self.partial)
                    self.partial, self.line_start = b"", False
                break
            self._line(self.partial + data[i:nl + 1], out)
            self.partial = b""
            i = nl + 1
        return b"".join(out)

    def close(self) -> bytes:
        out: list[bytes] = []
        if not self.in_banner:
            self._release(out)
            out.append(self.partial)
        self.partial, self.in_banner = b"", False
        return b"".join(out)


class _Pump(threading.Thread):
    """Copies one of the job's output streams to ours through a BannerFilter."""

    def __init__(self, src, dst, keep_banner: bool, on_broken: Callable[[], None]):
        super().__init__(daemon=True, name="mpiexec-output")
        self.src, self.dst, self.on_broken = src, dst, on_broken
        self.filter = None if keep_banner else BannerFilter()
        self.reported = False  # a line starting with "Error: " went through
        self.broken = False  # our reader went away (`pipeinfer … | head`)
        self.start()

    @property
    def exit_string(self) -> str | None:
        return self.filter.exit_string if self.filter else None

    def run(self) -> None:
        fd = self.src.fileno()
        while chunk := os.read(fd, 1 << 16):
            if self.filter is not None:
                chunk = self.filter.feed(chunk)
                self.reported = self.reported or any(l.startswith(b"Error: ") for l in self.filter.lines)
                self.filter.lines.clear()
            elif b"Error: " in chunk:
                self.reported = True
            self._write(chunk)
        if self.filter is not None:
            self._write(self.filter.close())

    def _write(self, data: bytes) -> None:
        if not data or self.broken:
            return  # keep draining the job's output, so that mpiexec never blocks on a full pipe
        try:
            self.dst.write(data)
            self.dst.flush()
        except (BrokenPipeError, ValueError):
            # Like a command killed by SIGPIPE: stop the job, and leave quietly (writes to a
            # devnull from now on, so that Python's own flush at exit does not complain).
            self.broken = True
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.dst.fileno())
            os.close(devnull)
            self.on_broken()


def _report(msg: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # the terminal may be gone (SIGHUP)
        sys.stdout.flush()
        sys.stderr.write(f"Error: {msg}\n")
        sys.stderr.flush()
