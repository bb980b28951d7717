"""A dedicated draft rank (`--layer-split …/1`): the draft model runs in its own process.

The head sends the path to continue; the draft rank answers with its proposal. Arrays only.
"""

from __future__ import annotations

import time

import numpy as np

from ..transport.messages import Msg, Tag
from ..transport.mpi_link import Link
from .drafters import Proposal
from .metrics import now


class RemoteDrafter:
    """Head-side proxy with the Drafter interface."""

    name = "model"

    def __init__(self, link: Link, rank: int):
        self.link, self.rank = link, rank

    def request(self, path: list[int], n_max: int, p_min: float) -> None:
        msg = np.asarray([Msg.RUN, n_max, int(p_min * 1e6), *path], np.int64)
        self.link.send_array(msg, self.rank, Tag.DRAFT_REQ)

    def poll(self) -> Proposal | None:
        st = self.link.probe(self.rank, Tag.DRAFT_REP)
        if st is None:
            return None
        return self._decode(self.link.recv_array(self.rank, Tag.DRAFT_REP, np.float64, st))

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        self.request(path, n_max, p_min)
        return self._decode(self.link.recv_array(self.rank, Tag.DRAFT_REP, np.float64))

    @staticmethod
    def _decode(rep: np.ndarray) -> Proposal:
        n = int(rep[0])
        toks = [int(x) for x in rep[1:1 + n]]
        return Proposal(toks, [float(x) for x in rep[1 + n:1 + 2 * n]], [[] for _ in toks])

    def close(self) -> None:
        pass


def serve_draft(link: Link, drafter, threads: int, trace) -> None:
    """Answer the head's draft requests until SHUTDOWN; report counters at each REPORT."""
    from .stage import rank_report

    busy = 0.0
    n_req = 0
    cpu0 = time.process_time()
    while True:
        msg = link.recv_array(0, Tag.DRAFT_REQ, np.int64)
        if int(msg[0]) == Msg.SHUTDOWN:
            break
        if int(msg[0]) == Msg.REPORT:
            link.send_object(rank_report(link.rank, "draft", None, threads, busy, cpu0, trace, runs=n_req), 0, Tag.STATS)
            continue
        n_max, p_min = int(msg[1]), msg[2] / 1e6
        t0 = now()
        prop = drafter.propose([int(x) for x in msg[3:]], n_max, p_min)
        t1 = now()
        busy += t1 - t0
        n_req += 1
        trace.slice("draft", t0, t1, n_tokens=len(prop.tokens))
        rep = np.asarray([len(prop.tokens), *prop.tokens, *prop.probs], np.float64)
        link.send_array(rep, 0, Tag.DRAFT_REP)
    link.flush()
