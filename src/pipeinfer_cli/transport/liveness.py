"""Hung ranks: heartbeats and a progress deadline, so that a rank that stops answering ends the job.

With `--rank-timeout T` (seconds, DEFAULT_RANK_TIMEOUT_S; 0 turns all of this off) every rank
sends a heartbeat every min(T/4, BEAT_MAX_INTERVAL_S) seconds from a thread of its own: the head
to every other rank, every other rank to the head. A heartbeat is three int64s: what the rank is
doing (idle, computing with visible progress, computing opaquely) and two progress counters (the
messages it sent and received, the layers of its current eval done). It is sent whatever the main
thread does, so a long eval is not silence; its counters show whether that eval moves.

The head, whenever it waits for a message, ends the job with RankUnresponsiveError (naming the
rank, its role and host) when, for T seconds:

- a rank sent nothing at all: stopped (SIGSTOP), frozen, or its host unreachable;
- a rank said it was computing and its progress did not move: stuck in a compute. One layer of
  one eval must therefore finish within T (a prompt chunk is 256 tokens);
- nothing moved anywhere while the head waited: every rank is alive and idle, so a message was
  lost; the rank whose message the head waits for is named.

Every other rank, whenever it waits for the head, ends when the head sent nothing for T seconds or
is stuck in a compute (HeadUnresponsiveError; runtime/worker.py prints it from rank 1 only).

Cost: a 32-byte message every 5 s per rank (at the default), nothing per token; the checks run in
the ranks' wait loops at most every CHECK_EVERY_S, and the heartbeat thread sleeps in between.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ..errors import PipeinferError
from .deadlines import BEAT_MAX_INTERVAL_S, DEFAULT_RANK_TIMEOUT_S  # noqa: F401 - DEFAULT is part of this API
from .messages import Tag
from .mpi_link import BUSY, BUSY_IDLE, BUSY_OPAQUE, Link, RankFailedError

CHECK_EVERY_S = 0.05
FAREWELL = -1  # a last heartbeat: this rank stopped sending them (it is shutting down)
_FIX = "raise --rank-timeout (0 disables the check)"


class RankUnresponsiveError(RankFailedError):
    """Head side: a rank stopped answering or progressing; the message names it."""


class HeadUnresponsiveError(PipeinferError):
    """A non-head rank: the head stopped answering or progressing."""


@dataclass
class PeerState:
    """What this rank knows of a rank it watches (times are time.monotonic())."""

    last_heard: float  # its last heartbeat or message
    last_change: float  # the last time its progress moved (or it sent a message)
    beat: tuple[int, ...] = ()  # its last heartbeat: (busy, messages, layers done)

    @property
    def busy(self) -> int:
        return self.beat[0] if self.beat else BUSY_IDLE


class Liveness:
    """This rank's heartbeats, and the deadline on the ranks it watches (the module doc)."""

    def __init__(self, link: Link, timeout_s: float, layers_done: Callable[[], int] = lambda: 0):
        self.link, self.timeout_s, self.layers_done = link, float(timeout_s), layers_done
        self.interval_s = min(self.timeout_s / 4, BEAT_MAX_INTERVAL_S)
        self.busy = BUSY_IDLE  # set by Link.computing() and by a stall fault
        self.watched = list(range(1, link.size)) if link.rank == 0 else [0]
        now = time.monotonic()
        self.peers = {r: PeerState(now, now) for r in self.watched}
        self.last_progress = now  # head: the last time anything moved anywhere
        self._checked = 0.0
        self._stop = threading.Event()
        self._pending: list[tuple[MPI.Request, np.ndarray]] = []  # the heartbeat thread's own sends
        self._thread = threading.Thread(target=self._beat_loop, daemon=True, name="heartbeat")

    def start(self) -> "Liveness":
        self.link.liveness = self
        self._thread.start()
        return self

    def stop(self, farewell: bool = False) -> None:
        """No more heartbeats or checks (the job is ending normally).

        farewell: a non-head rank told to shut down says so to the head, which waits for it before
        it leaves: a heartbeat sent to a head that has already finalized MPI can crash the sender."""
        self.link.liveness = None
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)  # it wakes at once; it must not touch MPI once the rank finalizes
        if farewell:
            bye = np.asarray([FAREWELL, 0, 0], np.int64)
            self._pending.append((self.link.comm.Isend([bye, MPI.BYTE], dest=0, tag=int(Tag.HEARTBEAT)), bye))
        deadline = time.monotonic() + 5.0
        while self._pending and time.monotonic() < deadline:
            self._pending = [(r, b) for r, b in self._pending if not r.Test()]
            time.sleep(1e-3)

    def await_farewells(self, timeout_s: float = 5.0) -> None:
        """Head, after SHUTDOWN: wait (bounded) until every rank has stopped its heartbeats. Any
        other message still arriving is a stray (a duplicate nobody asked for): it is received and
        dropped, so that its sender's send completes and the rank can leave."""
        comm, status = self.link.comm, MPI.Status()
        left = set(self.watched)
        deadline = time.monotonic() + timeout_s
        while left and time.monotonic() < deadline:
            if not comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
                time.sleep(1e-3)
                continue
            source, tag = status.Get_source(), status.Get_tag()
            buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
            comm.Recv([buf, MPI.BYTE], source=source, tag=tag)
            if tag == Tag.HEARTBEAT and buf.nbytes == 24 and buf.view(np.int64)[0] == FAREWELL:
                left.discard(source)
            elif tag != Tag.HEARTBEAT:
                self.link.strays += 1

    # -- sending ---------------------------------------------------------------------------
    def _beat_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._pending = [(r, b) for r, b in self._pending if not r.Test()]
            beat = np.asarray([self.busy, self.link.n_messages, self.layers_done()], np.int64)
            faults = self.link.faults
            copies = 1 if faults is None else faults.copies(Tag.HEARTBEAT, lambda: None)
            for dest in self.watched:
                for _ in range(copies):
                    self._pending.append((self.link.comm.Isend([beat, MPI.BYTE], dest=dest, tag=int(Tag.HEARTBEAT)), beat))

    # -- watching ---------------------------------------------------------------------------
    def heard(self, rank: int) -> None:
        """A message from rank arrived: it is alive and moving."""
        now = time.monotonic()
        peer = self.peers.get(rank)
        if peer is not None:
            peer.last_heard = peer.last_change = now
        self.last_progress = now

    def _drain(self, now: float) -> None:
        status, buf = MPI.Status(), np.empty(3, np.int64)
        while self.link.comm.Iprobe(source=MPI.ANY_SOURCE, tag=int(Tag.HEARTBEAT), status=status):
            self.link.comm.Recv([buf, MPI.BYTE], source=status.Get_source(), tag=int(Tag.HEARTBEAT))
            peer = self.peers.get(status.Get_source())
            if peer is None:
                continue
            beat = tuple(int(x) for x in buf)
            peer.last_heard = now
            if beat != peer.beat or beat[0] == BUSY_OPAQUE:  # an opaque compute cannot show progress
                peer.last_change = self.last_progress = now
            peer.beat = beat

    def check(self, awaiting: tuple[int, Tag] | None = None, since: float | None = None) -> None:
        """Raise if a watched rank stopped answering or progressing (see the module doc).

        awaiting: the (rank, tag) the caller waits for; since: when its wait began."""
        now = time.monotonic()
        if now - self._checked < CHECK_EVERY_S:
            return
        self._checked = now
        self._drain(now)
        T = self.timeout_s
        for r, peer in self.peers.items():
            if now - peer.last_heard > T:
                self._fail(r, f"sent nothing for {T:g} s{self._while(r, awaiting)}; it may be hung, stopped or "
                              f"overloaded ({_FIX})")
            if peer.busy == BUSY and now - peer.last_change > T:
                self._fail(r, f"made no progress in its compute for {T:g} s; it may be stuck or overloaded ({_FIX})")
        if self.link.rank == 0 and since is not None and now - max(self.last_progress, since) > T:
            rank, tag = awaiting if awaiting is not None else (self.watched[-1], None)
            what = f"its {tag.name} message" if tag is not None else "a message"
            raise RankUnresponsiveError(
                f"nothing moved in the job for {T:g} s while the head waited for {what} from "
                f"{self.link.names[rank]}, which is alive and idle: a message was lost ({_FIX} if the "
                f"network is only slow)")

    def _while(self, rank: int, awaiting: tuple[int, Tag] | None) -> str:
        """What the head was waiting for, as the end of an error message."""
        if self.link.rank != 0 or awaiting is None:
            return ""
        source, tag = awaiting
        if tag in (Tag.RESULT, Tag.RESULT_DATA):
            return " while a run was in flight"
        whose = "its" if source == rank else f"rank {source}'s"
        return f" while the head waited for {whose} {tag.name} message"

    def _fail(self, rank: int, what: str) -> None:
        if self.link.rank == 0:
            raise RankUnresponsiveError(f"{self.link.names[rank]} {what}")
        raise HeadUnresponsiveError(f"{self.link.names[rank]} {what}")
