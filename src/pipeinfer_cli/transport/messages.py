"""Wire format of the pipeline. Every message is a flat numpy array: no pickle on the hot path.

One ordered stream per link (rank r -> r+1) carries, in order: run headers, their payloads, KV
operations and SHUTDOWN. Headers and KV operations use tag STREAM; a payload (hidden states)
follows its header on tag PAYLOAD. MPI keeps messages of one (source, tag) in order, and a
receiver always takes a header's payload right after the header, so the stream stays ordered.

Every array message has a class here with `encode()` and `decode()`: RunHeader, KvCommand,
ResultHeader (last stage -> head), DraftRequest and DraftReply (head <-> draft rank). Only ERROR,
STATS, the clock probes at start and `calibrate`'s orders and results are pickled (rare control
messages, never on the hot path).
`Link` adds a sequence number to every message (see mpi_link.py); heartbeats are liveness.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np


class Tag(IntEnum):
    STREAM = 1  # run headers, KV operations, SHUTDOWN (rank r -> r+1)
    PAYLOAD = 2  # hidden states of the run whose header came just before
    RESULT = 3  # last stage -> head: ResultHeader; followed by RESULT_DATA
    RESULT_DATA = 4  # the sampled token of each requested row (int64): logits never cross the network
    CANCEL = 5  # head -> every stage, directly: run ids to drop
    ERROR = 6  # any rank -> head: a fatal error (small pickled string; never on the hot path)
    ABORT = 7  # head -> every rank: stop now, the job failed
    STATS = 8  # stage or draft rank -> head after each request (REPORT): counters and trace events, pickled
    DRAFT_REQ = 9  # head -> draft rank: DraftRequest
    DRAFT_REP = 10  # draft rank -> head: DraftReply
    CLOCK = 11  # clock-offset probes at start (pickled floats)
    HEARTBEAT = 12  # head <-> every other rank, every few seconds with --rank-timeout: [busy, progress...]
    STARTUP = 13  # start-up check-ins (rank -> head) and the head's answer (go / abort), pickled
    CALIBRATE = 14  # `pipeinfer calibrate`: the head's orders and every rank's measurements, pickled
    WEIGHTS = 15  # head -> a rank without the model file: its weights, in chunks (runtime/weight_stream.py)
    WEIGHTS_CTL = 16  # head -> that rank: the stream's start (its size) and end (its sha256), pickled


class Msg(IntEnum):
    RUN = 1  # a run header (STREAM), or a draft proposal request (DRAFT_REQ)
    KV = 2
    SHUTDOWN = 3
    REPORT = 4  # end of one request: every rank sends its counters and trace events to the head
    DRAFT_START = 5  # DRAFT_REQ: process this prompt (no reply)
    SAMPLING = 6  # STREAM: the sampling parameters of the runs that follow (the last stage samples)
    KV_USAGE = 7  # STREAM or DRAFT_REQ: every rank sends the head its KV cells in use (STATS), in stream order


class KvOp(IntEnum):
    SEQ_RM = 1  # (seq, p0, p1)
    SEQ_CP = 2  # (src, p0, p1, dsts...): copy to one or many sequences in one message
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
    output: np.ndarray  # bool (n,): rows whose sampled next token the head wants
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
    seq: int = -1  # SEQ_RM: the sequence; SEQ_CP: the source
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
        elif self.op == KvOp.CLEAR:
            engine.kv_clear()


SHUTDOWN = np.asarray([Msg.SHUTDOWN], np.int64)
REPORT = np.asarray([Msg.REPORT], np.int64)
KV_USAGE = np.asarray([Msg.KV_USAGE], np.int64)


@dataclass
class ResultHeader:
    """Last stage -> head (tag RESULT): which run the sampled tokens that follow (RESULT_DATA) belong to.

    A cancelled run, or one that asked for no rows (a prompt chunk before the last), has no data."""

    run_id: int
    n_out: int  # sampled tokens that follow, one per requested row
    cancelled: bool = False

    def encode(self) -> np.ndarray:
        return np.asarray([self.run_id, self.n_out, int(self.cancelled)], np.int64)

    @staticmethod
    def decode(buf: np.ndarray) -> "ResultHeader":
        return ResultHeader(int(buf[0]), int(buf[1]), bool(buf[2]))

    @property
    def has_data(self) -> bool:
        return not self.cancelled and self.n_out > 0


def _f64_bits(values) -> np.ndarray:
    """Floats carried bit for bit inside an int64 message."""
    return np.asarray(values, np.float64).view(np.int64)


@dataclass
class SamplingSpec:
    """Head -> every stage in stream order (Msg.SAMPLING): how the last stage samples the rows of
    the runs that follow. The fields are decode.sampling.SamplingParams' own; floats bit-exact."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int

    def encode(self) -> np.ndarray:
        return np.concatenate([np.asarray([Msg.SAMPLING, self.top_k, self.seed], np.int64),
                               _f64_bits([self.temperature, self.top_p, self.min_p])])

    @staticmethod
    def decode(buf: np.ndarray) -> "SamplingSpec":
        temperature, top_p, min_p = (float(x) for x in buf[3:6].view(np.float64))
        return SamplingSpec(temperature, int(buf[1]), top_p, min_p, int(buf[2]))


# How many tokens a draft rank's stream drafts beyond what a request asked for (without a confidence
# cutoff): the next request, which continues the path with the tokens just launched, usually finds
# them drafted or being drafted already.
STREAM_AHEAD = 32


@dataclass
class DraftRequest:
    """Head -> draft rank (tag DRAFT_REQ): start a prompt, stream a continuation, report, or stop.

    A RUN opens a stream: the draft rank sends one DraftReply per drafted token, all with this
    request's `stream` id, until n_max tokens, a token under p_min (the last, flagged final), or a
    newer request arrives (then it stops without a final piece: the head ignores the old id)."""

    kind: Msg  # DRAFT_START, RUN (propose), REPORT, KV_USAGE or SHUTDOWN
    path: list[int] = field(default_factory=list)  # DRAFT_START: the prompt; RUN: the path to continue
    n_max: int = 0  # RUN: draft at most this many tokens; DRAFT_START: prompt tokens the target reused
    p_min: float = 0.0  # RUN: stop after the first token whose top probability falls below this
    stream: int = 0  # RUN: the id its replies carry

    def encode(self) -> np.ndarray:
        return np.concatenate([np.asarray([self.kind, self.n_max], np.int64), _f64_bits([self.p_min]),
                               np.asarray([self.stream, *self.path], np.int64)])

    @staticmethod
    def decode(buf: np.ndarray) -> "DraftRequest":
        p_min = float(buf[2:3].view(np.float64)[0]) if len(buf) > 2 else 0.0
        n_max = int(buf[1]) if len(buf) > 1 else 0
        stream = int(buf[3]) if len(buf) > 3 else 0
        return DraftRequest(Msg(int(buf[0])), [int(x) for x in buf[4:]], n_max, p_min, stream)


@dataclass
class DraftReply:
    """Draft rank -> head (tag DRAFT_REP): a piece of a stream (DraftRequest): the tokens drafted
    since the last piece and the draft's probability of each; final: the stream ends here."""

    tokens: list[int]
    probs: list[float]
    stream: int = 0
    final: bool = True

    def encode(self) -> np.ndarray:
        return np.concatenate([np.asarray([len(self.tokens), self.stream, int(self.final), *self.tokens], np.int64),
                               _f64_bits(self.probs)])

    @staticmethod
    def decode(buf: np.ndarray) -> "DraftReply":
        n = int(buf[0])
        return DraftReply([int(x) for x in buf[3:3 + n]], [float(x) for x in buf[3 + n:3 + 2 * n].view(np.float64)],
                          int(buf[1]), bool(buf[2]))
