"""A dedicated draft rank (`--layer-split …/1`): the draft model runs in its own process.

The head sends the path to continue; the draft rank answers with its proposal. Arrays only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..transport.messages import DraftReply, DraftRequest, Msg, Tag
from ..transport.mpi_link import Link
from ..decode.cpu_account import PROCESS, WAIT
from ..decode.drafters import Drafter, Proposal
from ..decode.trace import TraceRecorder
from ..decode.metrics import now
from .rank_report import JobAborted, KvUsage, RankReporter, fault_injection

if TYPE_CHECKING:
    from .weight_stream import LoadedWeights


class RemoteDrafter:
    """Head-side proxy with the Drafter interface.

    `propose` is synchronous (speculative mode). pipeinfer mode uses it asynchronously: `request`
    sends a path, `poll` returns the reply once it has arrived (with `Proposal.base` = that path),
    and at most one request is outstanding, so a reply always answers the last request.
    """

    name = "model"
    # The draft rank reads the prompt on its own cores, and keeps its KV there (it reports its size
    # itself, serve_draft).
    has_prompt_pass = False

    def __init__(self, link: Link, rank: int):
        self.link, self.rank = link, rank
        self.requested: list[int] | None = None  # path of the outstanding request, if any

    @property
    def kv_tokens(self) -> list[int]:
        return []

    @property
    def outstanding(self) -> bool:
        return self.requested is not None

    def request(self, path: list[int], n_max: int, p_min: float) -> None:
        assert self.requested is None, "one draft request at a time"
        self.link.send_array(DraftRequest(Msg.RUN, list(path), n_max, p_min).encode(), self.rank, Tag.DRAFT_REQ)
        self.requested = list(path)

    def start(self, prompt: list[int], reuse: int = 0) -> None:
        """Have the draft rank process the prompt (no reply); reuse: see `Drafter.start`."""
        self.link.send_array(DraftRequest(Msg.DRAFT_START, list(prompt), n_max=reuse).encode(), self.rank, Tag.DRAFT_REQ)

    def ready(self) -> bool:
        """True if the outstanding request's reply has arrived (not received yet)."""
        return self.link.probe(self.rank, Tag.DRAFT_REP) is not None

    def poll(self) -> Proposal | None:
        st = self.link.probe(self.rank, Tag.DRAFT_REP)
        if st is None:
            self.link.progress_sends()
            return None
        reply = DraftReply.decode(self.link.recv_array(self.rank, Tag.DRAFT_REP, np.int64, st))
        prop = Proposal(reply.tokens, reply.probs, [[] for _ in reply.tokens])
        prop.base, self.requested = self.requested, None
        return prop

    def wait(self) -> Proposal | None:
        """Wait (without spinning) for the outstanding request's reply, if any."""
        if self.requested is None:
            return None
        # A failed rank (the draft rank itself, or a stage) reports to the head: stop waiting then.
        self.link.wait_probe(self.rank, Tag.DRAFT_REP, on_idle=self.link.raise_reported_error)
        return self.poll()

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        self.request(path, n_max, p_min)
        return self.wait()

    def close(self) -> None:
        pass


def serve_draft(link: Link, drafter: Drafter, threads: int, trace: TraceRecorder,
                weights: LoadedWeights | None = None) -> None:
    """Answer the head's draft requests until SHUTDOWN; report this request's counters at each REPORT."""

    def check_abort() -> None:
        if link.abort_requested():
            raise JobAborted()

    fail_at = fault_injection(link)
    n_req = 0  # over the whole job, for fault injection
    report = RankReporter(link.rank, "draft", None, threads, trace, link=link, weights=weights)
    while True:
        with PROCESS.charge(WAIT):
            st = link.wait_probe(0, Tag.DRAFT_REQ, on_idle=check_abort)
        req = DraftRequest.decode(link.recv_array(0, Tag.DRAFT_REQ, np.int64, st))
        if req.kind == Msg.SHUTDOWN:
            if link.liveness is not None:
                link.liveness.stop(farewell=True)
            break
        if req.kind == Msg.REPORT:
            link.send_pickled(report.take(), 0, Tag.STATS)
            continue
        if req.kind == Msg.KV_USAGE:  # tokens in the draft model's cache (0 for lookup drafting)
            link.send_pickled(KvUsage(link.rank, len(drafter.kv_tokens)), 0, Tag.STATS)
            continue
        t0 = now()
        if req.kind == Msg.DRAFT_START:
            with link.computing(observable=False):  # llama.cpp shows no progress inside an eval
                drafter.start(req.path, req.n_max)
            trace.slice("draft", t0, now(), n_tokens=0, prefill=True)
            continue
        if fail_at is not None and n_req + 1 >= fail_at:
            raise RuntimeError(f"injected fault (PIPEINFER_DEBUG_FAULT) on draft request {n_req + 1}")
        with link.computing(observable=False):
            prop = drafter.propose(req.path, req.n_max, req.p_min)
        t1 = now()
        report.busy_s += t1 - t0
        report.runs += 1
        n_req += 1
        trace.slice("draft", t0, t1, n_tokens=len(prop.tokens))
        link.send_array(DraftReply(prop.tokens, prop.probs).encode(), 0, Tag.DRAFT_REP)
    link.flush()
