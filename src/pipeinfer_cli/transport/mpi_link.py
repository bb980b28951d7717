"""Point-to-point helpers over mpi4py that never spin, and the job's fault protocol on the wire.

The mpich wheel's blocking Recv busy-waits (a full core while idle), and several ranks may share a
core, so every wait here is Iprobe + sleep with exponential backoff, reset on progress.
Sends are non-blocking: the buffers stay referenced until MPI reports them complete.

`Link` is the only owner of the communicator. Besides arrays it carries the fault protocol: a
failed rank reports its error to the head (`report_error`), the head raises it
(`raise_reported_error`) and tells every rank to stop (`abort_all`), which each rank notices with
`abort_requested`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from ..errors import PipeinferError
from .messages import Tag


class RankFailedError(PipeinferError):
    """Another rank of the job failed; the message names the rank and its error."""


BACKOFF_MIN_S = 20e-6
BACKOFF_MAX_S = 1e-3  # the longest sleep of a rank that has been idle for a while
# A rank that just made progress expects the next message soon (the pipeline is running): for
# BACKOFF_HOT_S it sleeps at most BACKOFF_HOT_MAX_S between probes. With a 1 ms cap from the
# start, a run waited 1.7 ms (p50) between two stages on shared memory; with 0.1 ms, 0.65 ms, and
# 2-rank iterative decoding went from 46 to 53 tok/s (SmolLM2, 1 thread per rank).
BACKOFF_HOT_MAX_S = 1e-4
BACKOFF_HOT_S = 0.05


class Backoff:
    """Sleep a little longer each idle round, finely while the wait is young; reset() after progress."""

    def __init__(self, lo: float = BACKOFF_MIN_S, hi: float = BACKOFF_MAX_S,
                 hot_hi: float = BACKOFF_HOT_MAX_S, hot_s: float = BACKOFF_HOT_S):
        self.lo, self.hi, self.hot_hi, self.hot_s = lo, hi, min(hot_hi, hi), hot_s
        self.delay = lo
        self.idle_since: float | None = None

    def reset(self) -> None:
        self.delay = self.lo
        self.idle_since = None

    def idle(self) -> None:
        now = time.monotonic()
        if self.idle_since is None:
            self.idle_since = now
        time.sleep(self.delay)
        cap = self.hot_hi if now - self.idle_since < self.hot_s else self.hi
        self.delay = min(self.delay * 2, cap)


class Traffic:
    """What this rank moved since the last take(): array bytes and messages per peer, and the time
    spent waiting for messages (sleeping between probes)."""

    def __init__(self):
        self.sent: dict[int, list[int]] = {}  # dest -> [bytes, messages]
        self.received: dict[int, list[int]] = {}  # source -> [bytes, messages]
        self.wait_s = 0.0

    @staticmethod
    def _add(table: dict[int, list[int]], peer: int, nbytes: int) -> None:
        row = table.setdefault(peer, [0, 0])
        row[0] += nbytes
        row[1] += 1

    def take(self) -> dict:
        out = {"sent": {str(k): {"bytes": b, "messages": m} for k, (b, m) in sorted(self.sent.items())},
               "received": {str(k): {"bytes": b, "messages": m} for k, (b, m) in sorted(self.received.items())},
               "wait_s": round(self.wait_s, 4)}
        self.__init__()
        return out


class Link:
    """One rank's view of the communicator: probe, receive arrays, send without blocking."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._pending: list[tuple[MPI.Request, object]] = []
        self.traffic = Traffic()

    def allgather(self, obj) -> list:
        """Every rank's obj, on every rank (collective; pickled, for start-up only)."""
        return self.comm.allgather(obj)

    def ranks_on_this_host(self) -> int:
        return self.comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()

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
        Traffic._add(self.traffic.received, status.Get_source(), buf.nbytes)
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
            self.idle(backoff)

    def idle(self, backoff: Backoff) -> None:
        """Sleep one backoff step while waiting for a message (counted as waiting time)."""
        t0 = time.perf_counter()
        backoff.idle()
        self.traffic.wait_s += time.perf_counter() - t0

    # -- sending ---------------------------------------------------------------------------
    def send_array(self, arr: np.ndarray, dest: int, tag: Tag) -> None:
        arr = np.ascontiguousarray(arr)
        req = self.comm.Isend([arr, MPI.BYTE], dest=dest, tag=int(tag))
        self._pending.append((req, arr))
        Traffic._add(self.traffic.sent, dest, arr.nbytes)

    def send_pickled(self, obj, dest: int, tag: Tag) -> None:
        """Pickled send, for rare control messages only (errors, per-request stats, clock probes)."""
        req = self.comm.isend(obj, dest=dest, tag=int(tag))
        self._pending.append((req, obj))

    def recv_pickled(self, source: int, tag: Tag, on_idle: Callable[[], None] | None = None):
        """Wait (without spinning) for a pickled message and return it."""
        st = self.wait_probe(source, tag, on_idle=on_idle)
        return self.comm.recv(source=st.Get_source(), tag=int(tag))

    # -- the fault protocol ----------------------------------------------------------------
    def report_error(self, text: str) -> None:
        """A failed rank: tell the head (which prints it once and aborts the job)."""
        self.send_pickled(text, 0, Tag.ERROR)

    def raise_reported_error(self) -> None:
        """Head side: raise RankFailedError if a rank reported a failure."""
        st = self.probe(MPI.ANY_SOURCE, Tag.ERROR)
        if st is not None:
            msg = self.comm.recv(source=st.Get_source(), tag=int(Tag.ERROR))
            raise RankFailedError(f"rank {st.Get_source()}: {msg}")

    def abort_all(self) -> None:
        """Head side: tell every other rank to stop now (the job failed)."""
        for r in range(1, self.size):
            self.send_array(np.zeros(1, np.int64), r, Tag.ABORT)
        self.flush(timeout_s=2)

    def abort_requested(self) -> bool:
        """Did the head tell this rank to stop?"""
        return self.probe(0, Tag.ABORT) is not None

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
