"""Point-to-point helpers over mpi4py that never spin.

The mpich wheel's blocking Recv busy-waits (a full core while idle), and several ranks may share a
core, so every wait here is Iprobe + sleep with exponential backoff, reset on progress.
Sends are non-blocking: the buffers stay referenced until MPI reports them complete.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from .messages import Tag

BACKOFF_MIN_S = 20e-6
BACKOFF_MAX_S = 1e-3


class Backoff:
    """Sleep a little longer each idle round; reset() after any progress."""

    def __init__(self, lo: float = BACKOFF_MIN_S, hi: float = BACKOFF_MAX_S):
        self.lo, self.hi, self.delay = lo, hi, lo

    def reset(self) -> None:
        self.delay = self.lo

    def idle(self) -> None:
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, self.hi)


class Link:
    """One rank's view of the communicator: probe, receive arrays, send without blocking."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._pending: list[tuple[MPI.Request, object]] = []

    # -- receiving -------------------------------------------------------------------------
    def probe(self, source: int, tag: Tag) -> MPI.Status | None:
        status = MPI.Status()
        if self.comm.Iprobe(source=source, tag=int(tag), status=status):
            return status
        return None

    def recv_array(self, source: int, tag: Tag, dtype, status: MPI.Status | None = None) -> np.ndarray:
        """Receive a message known to be waiting (after probe) or wait for it without spinning."""
        if status is None:
            status = self.wait_probe(source, tag)
        n = status.Get_count(MPI.BYTE) // np.dtype(dtype).itemsize
        buf = np.empty(n, dtype=dtype)
        self.comm.Recv([buf, MPI.BYTE], source=status.Get_source(), tag=int(tag))
        return buf

    def wait_probe(self, source: int, tag: Tag, on_idle: Callable[[], None] | None = None) -> MPI.Status:
        backoff = Backoff()
        while True:
            st = self.probe(source, tag)
            if st is not None:
                return st
            if on_idle is not None:
                on_idle()
            self.progress_sends()
            backoff.idle()

    # -- sending ---------------------------------------------------------------------------
    def send_array(self, arr: np.ndarray, dest: int, tag: Tag) -> None:
        arr = np.ascontiguousarray(arr)
        req = self.comm.Isend([arr, MPI.BYTE], dest=dest, tag=int(tag))
        self._pending.append((req, arr))

    def send_object(self, obj, dest: int, tag: Tag) -> None:
        """Pickled send, for rare control messages only (errors, final stats)."""
        req = self.comm.isend(obj, dest=dest, tag=int(tag))
        self._pending.append((req, obj))

    def progress_sends(self) -> None:
        if self._pending:
            self._pending = [(r, b) for r, b in self._pending if not r.Test()]

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait (without spinning) until every send completed; False on timeout."""
        backoff = Backoff()
        deadline = time.monotonic() + timeout_s
        while self._pending:
            self.progress_sends()
            if not self._pending:
                break
            if time.monotonic() > deadline:
                return False
            backoff.idle()
        return True
