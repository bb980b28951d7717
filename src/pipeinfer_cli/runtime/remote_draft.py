"""A dedicated draft rank (`--layer-split …/1`): the draft model runs in its own process.

The head sends the path to continue; the draft rank answers with its proposal. Arrays only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..transport.messages import STREAM_AHEAD, DraftReply, DraftRequest, Msg, Tag
from ..transport.mpi_link import Link
from ..decode.cpu_account import PROCESS, WAIT
from ..decode.drafters import Drafter, Proposal, continues
from ..decode.trace import TraceRecorder
from ..decode.metrics import now
from .rank_report import JobAborted, KvUsage, RankReporter, fault_injection

if TYPE_CHECKING:
    from .weight_stream import LoadedWeights


@dataclass
class _Stream:
    """The tokens a draft rank streams for one request (DraftRequest.stream), as received so far."""

    id: int
    base: list[int]  # the path it continues
    n_max: int
    p_min: float
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    final: bool = False

    def offers(self, path: list[int]) -> bool:
        """Whether this stream continues `path` or will: path is consistent with what it drafted,
        and it has (or may still draft) a token beyond it."""
        return continues(self.base, self.tokens, path,
                         may_grow=not self.final and len(self.base) + self.n_max > len(path))


class RemoteDrafter:
    """Head-side proxy with the Drafter interface.

    `propose` is synchronous (speculative mode). pipeinfer mode uses it asynchronously: `request`
    asks for a path's continuation, `poll` returns it once some has arrived (with `Proposal.base` =
    that path), and at most one request is outstanding, so a reply always answers the last request.

    The draft rank streams its tokens one by one (`stream_draft`), up to STREAM_AHEAD beyond what was
    asked; a request that continues the open stream's path is answered from it without a message,
    so the draft rank keeps drafting while the head launches, and a reply comes as soon as one token
    past the path has arrived.
    """

    name = "model"
    # The draft rank reads the prompt on its own cores, and keeps its KV there (it reports its size
    # itself, serve_draft).
    has_prompt_pass = False

    def __init__(self, link: Link, rank: int):
        self.link, self.rank = link, rank
        # path, n_max and the tokens to draft beyond them, of the outstanding request
        self.requested: tuple[list[int], int, int] | None = None
        self.stream: _Stream | None = None
        self.next_id = 1

    @property
    def kv_tokens(self) -> list[int]:
        return []

    @property
    def outstanding(self) -> bool:
        return self.requested is not None

    def request(self, path: list[int], n_max: int, p_min: float) -> None:
        self._ask(path, n_max, p_min, STREAM_AHEAD)

    def _ask(self, path: list[int], n_max: int, p_min: float, ahead: int) -> None:
        assert self.requested is None, "one draft request at a time"
        self.requested = (list(path), n_max, ahead)
        st = self.stream
        if st is None or st.p_min != p_min or not st.offers(path):
            self._open(path, n_max + ahead, p_min)

    def _open(self, path: list[int], n_max: int, p_min: float) -> None:
        sid, self.next_id = self.next_id, self.next_id + 1
        self.link.send_array(DraftRequest(Msg.RUN, list(path), n_max, p_min, sid).encode(), self.rank, Tag.DRAFT_REQ)
        self.stream = _Stream(sid, list(path), n_max, p_min)

    def start(self, prompt: list[int], reuse: int = 0) -> None:
        """Have the draft rank process the prompt (no reply); reuse: see `Drafter.start`."""
        self.end_stream()
        self.link.send_array(DraftRequest(Msg.DRAFT_START, list(prompt), n_max=reuse).encode(), self.rank, Tag.DRAFT_REQ)

    def _receive(self) -> None:
        """Take every piece that has arrived; drop those of streams the head no longer follows."""
        while (st := self.link.probe(self.rank, Tag.DRAFT_REP)) is not None:
            piece = DraftReply.decode(self.link.recv_array(self.rank, Tag.DRAFT_REP, np.int64, st))
            cur = self.stream
            if cur is not None and piece.stream == cur.id:
                cur.tokens += piece.tokens
                cur.probs += piece.probs
                cur.final = piece.final
        self.link.progress_sends()

    def _answer(self, whole: bool = False) -> Proposal | None:
        """The reply to the outstanding request, if the stream has one now: the tokens past its
        path that have arrived (whole: only once all n_max have, or the stream ended)."""
        if self.requested is None or self.stream is None:
            return None
        path, n_max, ahead = self.requested
        st = self.stream
        if not st.offers(path):
            if st.final and st.p_min > 0:
                prop = Proposal([], [], [])  # the draft stopped under p_min before this path
            else:
                self._open(path, n_max + ahead, st.p_min)  # another path: ask afresh
                return None
        else:
            i = len(path) - len(st.base)
            got = st.tokens[i:i + n_max]
            if not got or (whole and len(got) < n_max and not st.final):
                return None
            prop = Proposal(got, st.probs[i:i + n_max], [[] for _ in got])
        prop.base, self.requested = path, None
        return prop

    def ready(self) -> bool:
        """True if the outstanding request's reply can be taken now."""
        if self.requested is None:
            return False
        if self.link.probe(self.rank, Tag.DRAFT_REP) is not None:
            return True
        st, path = self.stream, self.requested[0]
        return st is not None and len(st.base) + len(st.tokens) > len(path)

    def poll(self, whole: bool = False) -> Proposal | None:
        self._receive()
        return self._answer(whole)

    def wait(self, whole: bool = False) -> Proposal | None:
        """Wait (without spinning) for the outstanding request's reply, if any (whole: see _answer)."""
        while self.requested is not None:
            self._receive()
            prop = self._answer(whole)
            if prop is not None:
                return prop
            # A failed rank (the draft rank itself, or a stage) reports to the head: stop waiting then.
            self.link.wait_probe(self.rank, Tag.DRAFT_REP, on_idle=self.link.raise_reported_error)
        return None

    def end_stream(self) -> None:
        """Stop the draft rank's open stream and consume its pieces (the end of a request), so that
        the link holds nothing of it when the next request or the report comes."""
        self.requested = None
        st = self.stream
        if st is None:
            return
        if not st.final:
            self._open([], 0, 0.0)  # answered by one final, empty piece
            while not self.stream.final:
                self.link.wait_probe(self.rank, Tag.DRAFT_REP, on_idle=self.link.raise_reported_error)
                self._receive()
        self.stream = None

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        """Synchronous (speculative mode): n_max tokens, drafted after the request and no further."""
        self._ask(path, n_max, p_min, 0)
        return self.wait(whole=True)

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
        n_req += 1
        n_tokens = stream_draft(link, drafter, req)
        report.busy_s += now() - t0
        report.runs += 1
        trace.slice("draft", t0, now(), n_tokens=n_tokens)
    link.flush()


def stream_draft(link: Link, drafter: Drafter, req: DraftRequest) -> int:
    """Draft the continuation of req.path one token at a time, each sent as soon as it is drafted,
    so the head can launch a run with it while the next is drafted. Stops after req.n_max tokens or
    a token under req.p_min (flagged final), or as soon as the head sent anything newer (a request
    for another path, the end of the request): the head ignores this stream's id from then on.
    Returns the tokens drafted."""
    path, sent = list(req.path), 0
    if req.n_max <= 0:  # the head closes the stream (end of a request): a final piece, nothing drafted
        link.send_array(DraftReply([], [], req.stream, True).encode(), 0, Tag.DRAFT_REP)
        return 0
    while True:
        with link.computing(observable=False):
            prop = drafter.propose(path, 1, req.p_min)
        final = (not prop.tokens or sent + len(prop.tokens) >= req.n_max
                 or (req.p_min > 0 and prop.probs[-1] < req.p_min))
        link.send_array(DraftReply(prop.tokens, prop.probs, req.stream, final).encode(), 0, Tag.DRAFT_REP)
        sent += len(prop.tokens)
        path += prop.tokens
        if final or link.probe(0, Tag.DRAFT_REQ) is not None:
            return sent
        if link.abort_requested():  # the job is ending: no need to finish the stream
            raise JobAborted()
