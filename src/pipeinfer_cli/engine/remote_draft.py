"""A dedicated draft rank (`--layer-split …/1`): the draft model runs in its own process.

The head sends the path to continue; the draft rank answers with its proposal. Arrays only.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ..transport.messages import Msg, Tag
from ..transport.mpi_link import Link
from .drafters import Proposal
from .metrics import now


class RemoteDrafter:
    """Head-side proxy with the Drafter interface.

    `propose` is synchronous (speculative mode). pipeinfer mode uses it asynchronously: `request`
    sends a path, `poll` returns the reply once it has arrived (with `Proposal.base` = that path),
    and at most one request is outstanding, so a reply always answers the last request.
    """

    name = "model"
    asynchronous = True  # pipeinfer mode drafts ahead with request/poll instead of propose

    def __init__(self, link: Link, rank: int):
        self.link, self.rank = link, rank
        self.requested: list[int] | None = None  # path of the outstanding request, if any

    @property
    def outstanding(self) -> bool:
        return self.requested is not None

    def request(self, path: list[int], n_max: int, p_min: float) -> None:
        assert self.requested is None, "one draft request at a time"
        msg = np.asarray([Msg.RUN, n_max, int(p_min * 1e6), *path], np.int64)
        self.link.send_array(msg, self.rank, Tag.DRAFT_REQ)
        if n_max >= 0:
            self.requested = list(path)

    def start(self, prompt: list[int]) -> None:
        """Have the draft rank process the prompt (n_max = -1 marks a start request; no reply)."""
        self.request(prompt, -1, 0.0)

    def ready(self) -> bool:
        """True if the outstanding request's reply has arrived (not received yet)."""
        return self.link.probe(self.rank, Tag.DRAFT_REP) is not None

    def poll(self) -> Proposal | None:
        st = self.link.probe(self.rank, Tag.DRAFT_REP)
        if st is None:
            self.link.progress_sends()
            return None
        prop = self._decode(self.link.recv_array(self.rank, Tag.DRAFT_REP, np.float64, st))
        prop.base, self.requested = self.requested, None
        return prop

    def wait(self) -> Proposal | None:
        """Wait (without spinning) for the outstanding request's reply, if any."""
        if self.requested is None:
            return None
        # A failed rank (the draft rank itself, or a stage) reports to the head: stop waiting then.
        self.link.wait_probe(self.rank, Tag.DRAFT_REP, on_idle=lambda: raise_reported_error(self.link))
        return self.poll()

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        self.request(path, n_max, p_min)
        return self.wait()

    @staticmethod
    def _decode(rep: np.ndarray) -> Proposal:
        n = int(rep[0])
        toks = [int(x) for x in rep[1:1 + n]]
        return Proposal(toks, [float(x) for x in rep[1 + n:1 + 2 * n]], [[] for _ in toks])

    def close(self) -> None:
        pass


def raise_reported_error(link: Link) -> None:
    """Raise the error a failed rank sent to the head, if any (head side)."""
    from .pipeline import PipelineError

    st = link.probe(MPI.ANY_SOURCE, Tag.ERROR)
    if st is not None:
        msg = link.comm.recv(source=st.Get_source(), tag=int(Tag.ERROR))
        raise PipelineError(f"rank {st.Get_source()}: {msg}")


def serve_draft(link: Link, drafter, threads: int, trace) -> None:
    """Answer the head's draft requests until SHUTDOWN; report counters at each REPORT."""
    from .stage import JobAborted, fault_injection, rank_report

    def check_abort() -> None:
        if link.probe(0, Tag.ABORT) is not None:
            raise JobAborted()

    fail_at = fault_injection(link.rank)
    busy = 0.0
    n_req = 0
    cpu0 = time.process_time()
    while True:
        st = link.wait_probe(0, Tag.DRAFT_REQ, on_idle=check_abort)
        msg = link.recv_array(0, Tag.DRAFT_REQ, np.int64, st)
        if int(msg[0]) == Msg.SHUTDOWN:
            break
        if int(msg[0]) == Msg.REPORT:
            link.send_object(rank_report(link.rank, "draft", None, threads, busy, cpu0, trace, runs=n_req), 0, Tag.STATS)
            continue
        n_max, p_min = int(msg[1]), msg[2] / 1e6
        t0 = now()
        if n_max < 0:
            drafter.start([int(x) for x in msg[3:]])
            trace.slice("draft", t0, now(), n_tokens=0, prefill=True)
            continue
        if fail_at is not None and n_req + 1 >= fail_at:
            raise RuntimeError(f"injected fault (PIPEINFER_DEBUG_FAIL) on draft request {n_req + 1}")
        prop = drafter.propose([int(x) for x in msg[3:]], n_max, p_min)
        t1 = now()
        busy += t1 - t0
        n_req += 1
        trace.slice("draft", t0, t1, n_tokens=len(prop.tokens))
        rep = np.asarray([len(prop.tokens), *prop.tokens, *prop.probs], np.float64)
        link.send_array(rep, 0, Tag.DRAFT_REP)
    link.flush()
