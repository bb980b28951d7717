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
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import UsageError

# Variables that MPICH/Hydra, Open MPI, Slurm and PMIx set in every rank of a job.
_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "PMI_FD")
RELAUNCHED = "PIPEINFER_RELAUNCHED"
# Signals that stop the job. The job runs in its own session, so the terminal's Ctrl-C reaches
# only this process; it then stops every process of the job itself (see relaunch()).
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_GRACE_S = 0.5  # after SIGTERM to the job's processes, SIGKILL whatever is left
GONE_TIMEOUT_S = 1.0  # then wait this long at most for the killed processes to disappear
# Lines that Hydra's mpiexec and its proxies print about their own teardown, e.g.
# "[mpiexec@host] Sending Ctrl-C to processes as requested" or
# "[proxy:0@host] HYD_pmcd_pmip_control_cmd_cb (…) assert (!closed) failed".
LAUNCHER_PREFIXES = (b"[mpiexec@", b"[proxy:")
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


class _Proc(tuple):
    """(ppid, start time, state) of a process, from /proc/PID/stat."""

    ppid = property(lambda self: self[0])
    start = property(lambda self: self[1])
    state = property(lambda self: self[2])


def _process_table() -> dict[int, _Proc]:
    """Every process of the machine (Linux; {} where there is no /proc)."""
    table: dict[int, _Proc] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state ppid pgrp … starttime
        if len(fields) > 19:
            table[int(entry)] = _Proc((int(fields[1]), fields[19], fields[0]))
    return table


def _mpich_shm_files(pid: int) -> set[str]:
    """MPICH's shared-memory files that a process has mapped and that still have a name."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split(None, 5)[5].strip() for line in f
                    if "/dev/shm/mpich_" in line and not line.rstrip().endswith("(deleted)")}
    except (OSError, IndexError):
        return set()


class _Job:
    """mpiexec and every process under it: Hydra's proxies and the ranks.

    Hydra starts each proxy and each rank in a session of its own, so neither mpiexec's process
    group nor its session holds them: the job is the process tree under mpiexec. It is read from
    /proc when the job is stopped, while it is still whole, and every process is remembered with
    its start time, so that a signal never reaches an unrelated process that reused a pid. The
    ranks' MPICH shared-memory files, which a killed job leaves in /dev/shm, are removed once the
    job is gone.
    """

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self._lock = threading.RLock()  # also taken by signal handlers, which run in the main thread
        self._known: dict[int, bytes] = {}  # pid -> start time, of mpiexec and its descendants
        self._shm: set[str] = set()
        self._reaped = False
        self._stop_at: float | None = None
        self._timer: threading.Timer | None = None

    def _refresh(self) -> dict[int, _Proc]:
        """Add the processes now under mpiexec (or under a known process) to the known ones."""
        table = _process_table()
        if not self._reaped and self.proc.pid in table:
            self._known.setdefault(self.proc.pid, table[self.proc.pid].start)
        children: dict[int, list[int]] = {}
        for pid, info in table.items():
            children.setdefault(info.ppid, []).append(pid)
        todo = [pid for pid, start in self._known.items() if pid in table and table[pid].start == start]
        while todo:
            for child in children.get(todo.pop(), ()):
                if child not in self._known and child != os.getpid():
                    self._known[child] = table[child].start
                    self._shm |= _mpich_shm_files(child)
                    todo.append(child)
        return table

    def _alive(self, table: dict[int, _Proc]) -> list[int]:
        return [pid for pid, start in self._known.items()
                if pid in table and table[pid].start == start and table[pid].state != b"Z"]

    def signal(self, signum: int) -> None:
        """Send signum to mpiexec and every known process of the job that is still there."""
        with self._lock:
            table = self._refresh()
            if not self._reaped:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signum)
            for pid in self._alive(table):
                if pid != self.proc.pid:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signum)

    def stop(self) -> None:
        """SIGTERM to every process of the job, SIGKILL STOP_GRACE_S later to what is left."""
        with self._lock:
            if self._stop_at is not None:
                return
            self._stop_at = time.monotonic()
            self._timer = threading.Timer(STOP_GRACE_S, self.signal, (signal.SIGKILL,))
            self._timer.daemon = True
            self._timer.start()
            self.signal(signal.SIGTERM)

    def wait_exited(self) -> None:
        """Until mpiexec has exited, without reaping it (signal handlers run meanwhile)."""
        if hasattr(os, "waitid"):
            os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)
        else:
            self.proc.wait()

    def finish(self) -> int:
        """After mpiexec exited: if the job was stopped, make sure every process of it is gone
        (SIGKILL after the grace period) and remove its shared-memory files; reap mpiexec and
        return its exit status."""
        with self._lock:
            stop_at = self._stop_at
        if stop_at is not None:
            while self._alive(self._refresh()) and time.monotonic() < stop_at + STOP_GRACE_S:
                time.sleep(0.01)
            self.signal(signal.SIGKILL)
            deadline = time.monotonic() + GONE_TIMEOUT_S
            while self._alive(_process_table()) and time.monotonic() < deadline:  # mpiexec: a zombie, not alive
                time.sleep(0.01)
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            rc = self.proc.wait()
            self._reaped = True
            if stop_at is not None and not self._alive(_process_table()):
                for path in self._shm:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
        return rc


def relaunch(n_ranks: int, argv: list[str]) -> int:
    """Run this same command as an MPI job of n_ranks processes and return its exit code.

    The job runs in a session of its own, so a Ctrl-C at the terminal reaches only this process,
    not mpiexec (which would print "Sending Ctrl-C to processes as requested" into the output and
    wait for ranks that may be busy in C code, loading a model). On Ctrl-C, SIGTERM or SIGHUP this
    process stops the job itself: SIGTERM to every process of it, SIGKILL STOP_GRACE_S later,
    and it returns only once they are gone. What the launcher prints about its teardown is
    dropped, and the one line reported is `Error: interrupted`.

    The head prints its own errors; an abnormal end it could not report (a rank killed or
    crashed) is reported here, in one line.
    """
    cmd = [find_mpiexec(), "-n", str(n_ranks), sys.executable, "-m", "pipeinfer_cli", *argv]
    env = {**os.environ, RELAUNCHED: "1"}
    debug = os.environ.get("PIPEINFER_DEBUG", "") not in ("", "0")
    stopping = threading.Event()
    stopped_by: list[int] = []
    job: _Job | None = None

    def stop_job() -> None:
        stopping.set()  # first, so that the launcher's reaction to the stop is filtered
        if job is not None:
            job.stop()

    def on_signal(signum, _frame):
        if not stopped_by:  # a second Ctrl-C changes nothing: the job is being stopped already
            stopped_by.append(signum)
            stop_job()

    # The handlers come first: a stop that arrives while mpiexec starts stops it right after.
    previous = {s: signal.signal(s, on_signal) for s in _STOP_SIGNALS}
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=_die_with_parent())
    except BaseException:
        for s, handler in previous.items():
            signal.signal(s, handler)
        raise
    job = _Job(proc)
    pumps = (_Pump(proc.stdout, sys.stdout.buffer, debug, stop_job, stopping),
             _Pump(proc.stderr, sys.stderr.buffer, debug, stop_job, stopping, drop_when_stopping=True))
    try:
        if stopping.is_set():
            job.stop()
        job.wait_exited()
    finally:
        rc = job.finish()
        for s, handler in previous.items():
            signal.signal(s, handler)
        for pump in pumps:
            pump.join(timeout=2)
    if any(pump.broken for pump in pumps):
        return 128 + signal.SIGPIPE  # the reader went away: the job was stopped, nothing to report
    if stopped_by:
        signum = stopped_by[0]
        _report("interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}")
        return 128 + signum
    if rc != 0 and pumps[1].reported:
        return 1  # the head printed the error; the launcher may have killed the other ranks since
    if rc != 0:
        reason = pumps[0].exit_string or pumps[1].exit_string
        how = f"{reason}, " if reason else ""
        _report(f"the MPI job ended abnormally ({how}mpiexec exit status {rc}): a rank crashed or was killed, "
                "for example by the out-of-memory killer")
    return rc


class LauncherFilter:
    """Removes the launcher's own messages from a byte stream: from "[mpiexec@" or "[proxy:" to the
    end of that line, wherever it starts (Hydra writes into the same pipe as the ranks, so after a
    token streamed without newline its message may start mid-line). Used once the job is being
    stopped, when such messages only describe the teardown. Everything else passes at once, except
    a tail that may be the start of a launcher message.
    """

    def __init__(self, prefixes: tuple[bytes, ...] = LAUNCHER_PREFIXES):
        self.prefixes = prefixes
        self.held = b""  # the end of the last chunk, which may begin a prefix
        self.dropping = False  # inside a launcher message, up to its newline

    def _tail_to_hold(self, data: bytes) -> int:
        """Length of the longest end of data that is a proper start of a prefix."""
        best = 0
        for p in self.prefixes:
            for k in range(min(len(p) - 1, len(data)), best, -1):
                if data.endswith(p[:k]):
                    best = k
                    break
        return best

    def feed(self, data: bytes) -> bytes:
        data, self.held = self.held + data, b""
        out: list[bytes] = []
        i = 0
        while i < len(data):
            if self.dropping:
                nl = data.find(b"\n", i)
                if nl < 0:
                    break
                self.dropping, i = False, nl + 1
                continue
            hits = [k for k in (data.find(p, i) for p in self.prefixes) if k >= 0]
            if hits:
                out.append(data[i:min(hits)])
                self.dropping, i = True, min(hits)
                continue
            keep = self._tail_to_hold(data[i:])
            out.append(data[i:len(data) - keep])
            self.held = data[len(data) - keep:]
            break
        return b"".join(out)

    def close(self) -> bytes:
        held, self.held = self.held, b""
        return b"" if self.dropping else held


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
    """Copies one of the job's output streams to ours through a BannerFilter and, once the job is
    being stopped, a LauncherFilter (or, with drop_when_stopping, drops the rest of the stream).
    With debug set, everything passes."""

    def __init__(self, src, dst, debug: bool, on_broken: Callable[[], None], stopping: threading.Event,
                 drop_when_stopping: bool = False):
        super().__init__(daemon=True, name="mpiexec-output")
        self.src, self.dst, self.on_broken, self.stopping = src, dst, on_broken, stopping
        self.debug, self.drop_when_stopping = debug, drop_when_stopping
        self.filter = None if debug else BannerFilter()
        self.launcher_filter = LauncherFilter()
        self.reported = False  # a line starting with "Error: " went through
        self.broken = False  # our reader went away (`pipeinfer … | head`)
        self.start()

    @property
    def exit_string(self) -> str | None:
        return self.filter.exit_string if self.filter else None

    def _stopping(self) -> bool:
        return self.stopping.is_set() and not self.debug

    def run(self) -> None:
        fd = self.src.fileno()
        while chunk := os.read(fd, 1 << 16):
            if self.filter is not None:
                chunk = self.filter.feed(chunk)
                self.reported = self.reported or any(l.startswith(b"Error: ") for l in self.filter.lines)
                self.filter.lines.clear()
            elif b"Error: " in chunk:
                self.reported = True
            self._out(chunk)
        if self.filter is not None:
            self._out(self.filter.close())
        if self._stopping() and not self.drop_when_stopping:
            self._write(self.launcher_filter.close())

    def _out(self, data: bytes) -> None:
        if self._stopping():
            if self.drop_when_stopping:
                return
            data = self.launcher_filter.feed(data)
        self._write(data)

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
