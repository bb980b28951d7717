"""Wire format of the pipeline. Every message is a flat numpy array: no pickle on the hot path.

One ordered stream per link (rank r -> r+1) carries, in order: run headers, their payloads, KV
operations and SHUTDOWN. Headers and KV operations use tag STREAM; a payload (hidden states)
follows its header on tag PAYLOAD. MPI keeps messages of one (source, tag) in order, and a
receiver always takes a header's payload right after the header, so the stream stays ordered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np


class Tag(IntEnum):
    STREAM = 1  # run headers, KV operations, SHUTDOWN (rank r -> r+1)
    PAYLOAD = 2  # hidden states of the run whose header came just before
    LOGITS = 3  # last stage -> head: result header; followed by LOGITS_DATA
    LOGITS_DATA = 4
    CANCEL = 5  # head -> every stage, directly: run ids to drop
    ERROR = 6  # any rank -> head: a fatal error (small pickled string; never on the hot path)
    ABORT = 7  # head -> every rank: stop now, the job failed
    STATS = 8  # stage -> head at shutdown: counters (pickled dict, once per job)
    DRAFT_REQ = 9  # head -> draft rank
    DRAFT_REP = 10  # draft rank -> head
    CLOCK = 11  # clock-offset probes at start


class Msg(IntEnum):
    RUN = 1
    KV = 2
    SHUTDOWN = 3
    REPORT = 4  # end of one request: every rank sends its counters and trace events to the head


class KvOp(IntEnum):
    SEQ_RM = 1  # (seq, p0, p1)
    SEQ_CP = 2  # (src, p0, p1, dsts...): copy to one or many sequences in one message
    SEQ_KEEP = 3  # (seq)
    CLEAR = 4


RUN_FLAG_SKIP = 1  # the run was cancelled upstream: no payload follows, do not compute
RUN_FLAG_INVARIANT = 2  # compute each row exactly as a one-token batch (decode and verification runs)


@dataclass
class RunHeader:
    """One batch travelling down the pipeline.

    Shapes: pos, seq_ids and output have one entry per token; seq_ids[i] lists the sequences
    token i belongs to (several for a shared prefix in a token tree).
    """

    run_id: int
    pos: np.ndarray  # int32 (n,)
    seq_ids: list[list[int]]
    output: np.ndarray  # bool (n,): rows whose logits the head wants
    flags: int = 0
    speculative: bool = False

    @property
    def n_tokens(self) -> int:
        return len(self.pos)

    @property
    def n_out(self) -> int:
        return int(self.output.sum())

    def encode(self) -> np.ndarray:
        n = self.n_tokens
        counts = [len(s) for s in self.seq_ids]
        flat = [s for ids in self.seq_ids for s in ids]
        head = [Msg.RUN, self.run_id, n, self.flags, int(self.speculative)]
        return np.concatenate([
            np.asarray(head, np.int64), self.pos.astype(np.int64), np.asarray(counts, np.int64),
            np.asarray(flat, np.int64), self.output.astype(np.int64),
        ])

    @staticmethod
    def decode(buf: np.ndarray) -> "RunHeader":
        _, run_id, n, flags, spec = (int(x) for x in buf[:5])
        off = 5
        pos = buf[off:off + n].astype(np.int32)
        off += n
        counts = buf[off:off + n]
        off += n
        seq_ids = []
        for c in counts:
            seq_ids.append([int(x) for x in buf[off:off + c]])
            off += int(c)
        output = buf[off:off + n].astype(bool)
        return RunHeader(run_id=run_id, pos=pos, seq_ids=seq_ids, output=output, flags=flags, speculative=bool(spec))


@dataclass
class KvCommand:
    """A KV-cache operation applied by every stage in stream order."""

    op: KvOp
    seq: int = -1  # SEQ_RM/SEQ_KEEP: the sequence; SEQ_CP: the source
    p0: int = -1
    p1: int = -1
    dsts: list[int] = field(default_factory=list)  # SEQ_CP destinations

    def encode(self) -> np.ndarray:
        return np.asarray([Msg.KV, self.op, self.seq, self.p0, self.p1, *self.dsts], np.int64)

    @staticmethod
    def decode(buf: np.ndarray) -> "KvCommand":
        return KvCommand(op=KvOp(int(buf[1])), seq=int(buf[2]), p0=int(buf[3]), p1=int(buf[4]),
                         dsts=[int(x) for x in buf[5:]])

    def apply(self, engine) -> None:
        if self.op == KvOp.SEQ_RM:
            engine.seq_rm(self.seq, self.p0, self.p1)
        elif self.op == KvOp.SEQ_CP:
            engine.seq_cp_many(self.seq, self.dsts, self.p0, self.p1)
        elif self.op == KvOp.SEQ_KEEP:
            engine.seq_keep(self.seq)
        elif self.op == KvOp.CLEAR:
            engine.kv_clear()


SHUTDOWN = np.asarray([Msg.SHUTDOWN], np.int64)
REPORT = np.asarray([Msg.REPORT], np.int64)


def result_header(run_id: int, n_out: int, cancelled: bool) -> np.ndarray:
    """Last stage -> head: which run these logits belong to, and whether it was cancelled."""
    return np.asarray([run_id, n_out, int(cancelled)], np.int64)
