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

import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import TypedDict

import numpy as np
from mpi4py import MPI

from ..errors import PipeinferError
from .faults import FaultInjector
from .messages import Tag
from .waits import Backoff, WaitHistory, WaitPolicy  # noqa: F401 - Backoff and WaitPolicy are part of this module's API


class RankFailedError(PipeinferError):
    """Another rank of the job failed; the message names the rank and its error."""


BUSY_IDLE, BUSY, BUSY_OPAQUE = 0, 1, 2  # what a rank's heartbeats say it is doing (liveness.py)


class PeerTraffic(TypedDict):
    bytes: int
    messages: int


class WireTraffic(TypedDict):
    """A rank's traffic since the last take (its report's "wire"): per peer rank (as a string, a
    JSON key), and the seconds it waited for messages."""

    sent: dict[str, PeerTraffic]
    received: dict[str, PeerTraffic]
    wait_s: float


class Traffic:
    """What this rank moved since the last take(): array bytes and messages per peer, the time
    spent waiting for messages (sleeping between probes), and how often it woke up to probe again
    (each wake-up costs CPU, however short the sleep)."""

    def __init__(self):
        self.sent: dict[int, list[int]] = {}  # dest -> [bytes, messages]
        self.received: dict[int, list[int]] = {}  # source -> [bytes, messages]
        self.wait_s = 0.0
        self.wakeups = 0

    @staticmethod
    def _add(table: dict[int, list[int]], peer: int, nbytes: int) -> None:
        row = table.setdefault(peer, [0, 0])
        row[0] += nbytes
        row[1] += 1

    def take(self) -> WireTraffic:
        out = {"sent": {str(k): {"bytes": b, "messages": m} for k, (b, m) in sorted(self.sent.items())},
               "received": {str(k): {"bytes": b, "messages": m} for k, (b, m) in sorted(self.received.items())},
               "wait_s": round(self.wait_s, 4), "wakeups": self.wakeups}
        self.__init__()
        return out


class MessageLostError(RankFailedError):
    """A message of a link never arrived: the next one of its (source, tag) stream did instead."""


class _Received:
    """One message taken off the wire and checked (its sequence number), waiting to be consumed."""

    __slots__ = ("source", "data")

    def __init__(self, source: int, data):
        self.source, self.data = source, data

    def Get_source(self) -> int:  # noqa: N802 - the mpi4py Status spelling, which callers use
        return self.source


# Rare control messages sent pickled; every other tag carries one flat array.
PICKLED_TAGS = frozenset({Tag.ERROR, Tag.STATS, Tag.CLOCK, Tag.STARTUP, Tag.CALIBRATE, Tag.WEIGHTS_CTL})
_SEQ = np.dtype(np.int64)


class Link:
    """One rank's view of the communicator: probe, receive arrays, send without blocking.

    Every message carries a sequence number per (source, tag) stream (an int64 after an array's
    bytes, or a (seq, obj) pair when pickled). A receiver takes each message off the wire as soon as
    it probes it and checks the number: a repeated or older one (a duplicate, a stray) is dropped
    and counted, a gap means a message was lost and raises MessageLostError naming both ranks. MPI
    keeps the messages of one (source, tag) in order, so nothing else can be out of sequence.

    The caller hands it how to wait (wait_policy: a `WaitPolicy`; default: read from the environment) and
    the faults to inject (faults: a `FaultInjector`, e.g. `FaultInjector.from_env(rank)`; None: none).
    """

    def __init__(self, comm: MPI.Comm, wait_policy: WaitPolicy | None = None, faults: FaultInjector | None = None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._pending: list[tuple[MPI.Request, object]] = []
        self.traffic = Traffic()
        self.wait_policy = wait_policy if wait_policy is not None else WaitPolicy.from_env()
        self.wait_history = WaitHistory(predict=self.wait_policy.predict)
        self.faults = faults
        self._sent_seq: dict[tuple[int, int], int] = {}  # (dest, tag) -> last sequence number sent
        self._recv_seq: dict[tuple[int, int], int] = {}  # (source, tag) -> last sequence number taken
        self._inbox: dict[tuple[int, int], deque[_Received]] = {}
        self.strays = 0  # duplicated or stale messages recognised and dropped
        self.n_messages = 0  # sent and received: progress, as heartbeats report it
        self.liveness = None  # a liveness.Liveness once the job runs with a --rank-timeout
        self.names = [f"rank {r}" for r in range(self.size)]  # how errors name each rank (name_ranks)

    def name_ranks(self, names: list[str]) -> None:
        """How errors name each rank from now on (e.g. 'rank 1 (stage 2 of 3, host node02)')."""
        self.names = list(names)

    # -- waiting ---------------------------------------------------------------------------
    def backoff(self, **kwargs) -> Backoff:
        """A Backoff with this link's wait policy and history (kwargs: Backoff's lo, hi, site...)."""
        return Backoff(self.wait_policy, self.wait_history, **kwargs)

    def set_alone_on_cores(self, alone: bool) -> bool:
        """Whether this rank has its cores to itself: its waits made from now on stay awake after
        their predicted sleep if PIPEINFER_WAIT_SPIN=tail asked and it is alone. Returns the choice."""
        self.wait_policy = self.wait_policy.for_cores(alone)
        return self.wait_policy.spin_tail

    def set_cpu_quota(self, quota_cpus: float | None) -> None:
        """This rank's CFS quota in CPUs (None: none): below one CPU, its waits wake up less often
        (`WaitPolicy.for_quota`)."""
        self.wait_policy = self.wait_policy.for_quota(quota_cpus)

    # -- receiving -------------------------------------------------------------------------
    def probe(self, source: int, tag: Tag) -> _Received | None:
        """The next checked message of (source, tag) if one has arrived, without consuming it."""
        got = self._queued(source, tag)
        if got is not None:
            return got
        status = MPI.Status()
        while self.comm.Iprobe(source=source, tag=int(tag), status=status):
            got = self._take(status.Get_source(), Tag(tag), status)
            if got is not None:
                return got
        return None

    def _queued(self, source: int, tag: Tag) -> _Received | None:
        if source == MPI.ANY_SOURCE:
            queue = next((q for (s, t), q in list(self._inbox.items()) if t == tag and q), None)
        else:
            queue = self._inbox.get((source, int(tag)))
        return queue[0] if queue else None

    def _take(self, source: int, tag: Tag, status: MPI.Status) -> _Received | None:
        """Receive a probed message and check its sequence number; None if it was a stray."""
        if tag in PICKLED_TAGS:
            seq, data = self.comm.recv(source=source, tag=int(tag))
            nbytes = 0
        else:
            buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
            self.comm.Recv([buf, MPI.BYTE], source=source, tag=int(tag))
            seq, data, nbytes = int(buf[-_SEQ.itemsize:].view(np.int64)[0]), buf[:-_SEQ.itemsize], buf.nbytes
        key = (source, int(tag))
        last = self._recv_seq.get(key, 0)
        if seq <= last:
            self.strays += 1
            return None
        if seq != last + 1:
            raise MessageLostError(
                f"{tag.name} message {last + 1} from rank {source} to rank {self.rank} never arrived "
                f"(message {seq} did): the link lost it")
        self._recv_seq[key] = seq
        self.n_messages += 1
        if nbytes:
            Traffic._add(self.traffic.received, source, nbytes)
        if self.liveness is not None:
            self.liveness.heard(source)
        got = _Received(source, data)
        self._inbox.setdefault(key, deque()).append(got)
        return got

    def _pop(self, got: _Received, tag: Tag):
        self._inbox[(got.source, int(tag))].popleft()
        return got.data

    def recv_array(self, source: int, tag: Tag, dtype, status: _Received | None = None) -> np.ndarray:
        """Consume a message known to be waiting (after probe) or wait for it without spinning."""
        if status is None:
            status = self.wait_probe(source, tag)
        return self._pop(status, tag).view(dtype)

    def wait_probe(self, source: int, tag: Tag, on_idle: Callable[[], None] | None = None) -> _Received:
        backoff = self.backoff()
        while True:
            st = self.probe(source, tag)
            if st is not None:
                return st
            if on_idle is not None:
                on_idle()
            self.progress_sends()
            self.idle(backoff, awaiting=(source, tag))

    def idle(self, backoff: Backoff, awaiting: tuple[int, Tag] | None = None) -> None:
        """Sleep one backoff step while waiting for a message (counted as waiting time).

        With a --rank-timeout, first check that the ranks this one depends on are still alive and
        making progress (liveness.py); awaiting: the (rank, tag) this wait is for, if known."""
        if self.liveness is not None:
            self.liveness.check(awaiting, since=backoff.idle_since)
        t0 = time.perf_counter()
        backoff.idle()
        self.traffic.wait_s += time.perf_counter() - t0
        self.traffic.wakeups += 1

    @contextlib.contextmanager
    def computing(self, observable: bool = True):
        """Mark this rank busy computing (heartbeats say so). observable: its progress shows in
        the heartbeats (layers done), so a compute that stops progressing is noticed."""
        if self.liveness is None:
            yield
            return
        before = self.liveness.busy
        self.liveness.busy = BUSY if observable else BUSY_OPAQUE
        try:
            yield
        finally:
            self.liveness.busy = before

    # -- sending ---------------------------------------------------------------------------
    def _next_seq(self, dest: int, tag: Tag) -> tuple[int, int]:
        """(sequence number, copies to send): a fault may drop (0) or duplicate (2) the message;
        a dropped one still uses its number, so that the receiver sees the gap."""
        copies = 1 if self.faults is None else self.faults.copies(tag, self._stall)
        key = (dest, int(tag))
        seq = self._sent_seq[key] = self._sent_seq.get(key, 0) + 1
        self.n_messages += 1
        return seq, copies

    def _stall(self) -> None:
        if self.liveness is not None:
            self.liveness.busy = BUSY

    def send_array(self, arr: np.ndarray, dest: int, tag: Tag) -> None:
        seq, copies = self._next_seq(dest, tag)
        raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        buf = np.empty(raw.nbytes + _SEQ.itemsize, np.uint8)
        buf[:raw.nbytes] = raw
        buf[raw.nbytes:] = np.asarray([seq], np.int64).view(np.uint8)
        for _ in range(copies):
            self._pending.append((self.comm.Isend([buf, MPI.BYTE], dest=dest, tag=int(tag)), buf))
            Traffic._add(self.traffic.sent, dest, buf.nbytes)

    def send_pickled(self, obj, dest: int, tag: Tag) -> None:
        """Pickled send, for rare control messages only (errors, per-request stats, clock probes)."""
        seq, copies = self._next_seq(dest, tag)
        for _ in range(copies):
            self._pending.append((self.comm.isend((seq, obj), dest=dest, tag=int(tag)), obj))

    def arrives_within(self, source: int, tag: Tag, timeout_s: float) -> bool:
        """Wait (sleeping, coarsely: for rare control messages) up to timeout_s for a message of
        (source, tag), without consuming it; whether one arrived."""
        deadline = time.monotonic() + timeout_s
        backoff = self.backoff(hi=10e-3)
        while self.probe(source, tag) is None:
            if time.monotonic() >= deadline:
                return False
            self.progress_sends()
            backoff.idle()
        return True

    def recv_pickled(self, source: int, tag: Tag, on_idle: Callable[[], None] | None = None):
        """Wait (without spinning) for a pickled message and return it."""
        return self._pop(self.wait_probe(source, tag, on_idle=on_idle), tag)

    # -- the fault protocol ----------------------------------------------------------------
    def report_error(self, text: str) -> None:
        """A failed rank: tell the head (which prints it once and aborts the job)."""
        self.send_pickled(text, 0, Tag.ERROR)

    def raise_reported_error(self) -> None:
        """Head side: raise RankFailedError if a rank reported a failure."""
        st = self.probe(MPI.ANY_SOURCE, Tag.ERROR)
        if st is not None:
            raise RankFailedError(f"rank {st.Get_source()}: {self._pop(st, Tag.ERROR)}")

    def abort_all(self) -> None:
        """Head side: tell every other rank to stop now (the job failed)."""
        for r in range(1, self.size):
            self.send_array(np.zeros(1, np.int64), r, Tag.ABORT)
        self.flush(timeout_s=2)

    def abort_requested(self) -> bool:
        """Did the head tell this rank to stop?"""
        return self.probe(0, Tag.ABORT) is not None

    def sends_in_flight(self) -> int:
        """Sends not completed yet (a stream keeps this bounded to bound its memory)."""
        return len(self._pending)

    def progress_sends(self) -> None:
        if self._pending:
            self._pending = [(r, b) for r, b in self._pending if not r.Test()]

    def drop_unreceived(self) -> int:
        """Receive and drop every message that arrived for this rank and was never received (the
        head's last heartbeats, a duplicate nobody asked for); how many. A rank calls it last, once
        its job is over: MPICH's MPI_Finalize fails on a communicator with an unmatched message, and
        a rank that leaves without finalizing makes the launcher kill the others ("Killed (signal
        9)" after a job that printed the right text)."""
        status, n = MPI.Status(), 0
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
            buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
            self.comm.Recv([buf, MPI.BYTE], source=status.Get_source(), tag=status.Get_tag())
            n += 1
        return n

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait (without spinning) until every send completed; False on timeout."""
        backoff = self.backoff()
        deadline = time.monotonic() + timeout_s
        while self._pending:
            self.progress_sends()
            if not self._pending:
                break
            if time.monotonic() > deadline:
                return False
            backoff.idle()
        return True
