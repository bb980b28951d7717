"""The processes of a relaunched MPI job: find them all (Hydra starts proxies and ranks in
sessions of their own, so a process group does not reach them), stop them, and clean up after."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time

from .start_waits import WATCHDOG_NAME

STOP_GRACE_S = 0.5  # after SIGTERM to the job's processes, SIGKILL whatever is left
GONE_TIMEOUT_S = 1.0  # then wait this long at most for the killed processes to disappear


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


def _mpi_rank(pid: int) -> int | None:
    """The MPI rank a process of the job is, from the launcher's variables in its environment
    (None for a rank's start watchdog, which has them too: see start_waits.py)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
        with open(f"/proc/{pid}/comm", "rb") as f:
            if f.read().strip() == WATCHDOG_NAME:
                return None
    except OSError:
        return None
    for item in env:
        if item.startswith((b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK=")) and item.split(b"=", 1)[1].isdigit():
            return int(item.split(b"=", 1)[1])
    return None


def _mpich_shm_files(pid: int) -> set[str]:
    """MPICH's shared-memory files that a process has mapped and that still have a name."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split(None, 5)[5].strip() for line in f
                    if "/dev/shm/mpich_" in line and not line.rstrip().endswith("(deleted)")}
    except (OSError, IndexError):
        return set()


class JobProcesses:
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
        self.ranks: dict[int, int] = {}  # pid -> MPI rank, of the ranks seen so far
        self.first_ended: list[int] = []  # the rank(s) that ended first, unless the job was stopped

    def first_to_end(self, failed_pid: int | None) -> list[int]:
        """The rank(s) that ended first; where several ended between two looks (a loaded machine),
        the one the launcher saw fail (its banner's PID), if it is one of them."""
        rank = self.ranks.get(failed_pid) if failed_pid is not None else None
        return [rank] if len(self.first_ended) > 1 and rank in self.first_ended else list(self.first_ended)

    def watch_ranks(self, n_ranks: int, done: threading.Event, every_s: float = 0.2) -> None:
        """Note the pid of every rank as they start, then wait for the first to end (pidfds), so that
        a rank that dies can be named: the launcher's banner names whichever process it saw first."""
        while len(self.ranks) < n_ranks and not done.wait(every_s):
            with self._lock:
                if not self._reaped:
                    self._refresh()
        fds, gone = {}, []
        for pid, rank in list(self.ranks.items()):
            try:
                fds[os.pidfd_open(pid)] = rank
            except ProcessLookupError:  # it ended (and was reaped) between being seen and now
                gone.append(rank)
            except (OSError, AttributeError):
                pass
        if gone:
            for fd in fds:
                os.close(fd)
            self.first_ended = sorted(gone) if self._stop_at is None else []
            return
        if not fds:
            return
        try:
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            while not done.is_set():
                ended = [fds[fd] for fd, _ in poller.poll(int(every_s * 1000))]
                if ended:
                    self.first_ended = sorted(ended) if self._stop_at is None else []
                    return
        finally:
            for fd in fds:
                os.close(fd)

    def note_shared_memory(self) -> None:
        """Read which MPICH shared-memory files the job's processes map now (once they have started
        MPI), so that they are removed when the job ends, even if a rank was killed and could not."""
        with self._lock:
            if not self._reaped:
                self._refresh()

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
                    todo.append(child)
        # Read each time, not only when a process is first seen: it may not have exec'd the rank or
        # mapped its shared memory yet.
        for pid in self._alive(table):
            if pid != self.proc.pid:
                self._shm |= _mpich_shm_files(pid)
                if pid not in self.ranks and (rank := _mpi_rank(pid)) is not None:
                    self.ranks[pid] = rank
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

    def finish(self, ended: bool = False) -> int:
        """After mpiexec exited: if the job was stopped, make sure every process of it is gone
        (SIGKILL after the grace period) and remove its shared-memory files; reap mpiexec and
        return its exit status. ended: remove the shared-memory files of a job that ended by itself
        too (its processes are all gone: a killed rank could not remove them)."""
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
            if (stop_at is not None or self.first_ended or ended) and not self._alive(_process_table()):
                for path in self._shm:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
        return rc

