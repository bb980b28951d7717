"""The head's side of the pipeline: launch runs, send KV operations, cancel runs, collect results.

Rank 0 computes the first layers itself, then streams hidden states to rank 1. The last stage
samples the rows the head asked for and sends only the token ids straight back to rank 0: the
sampler is a pure function of (logits, seed, position), so the last stage picks exactly the token
the head would, and logits (n_vocab floats a row) never cross the network. With one stage the head
computes and samples everything, through the same function, and a run's result is ready when
`launch` returns.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..transport.messages import KV_USAGE, REPORT, RUN_FLAG_INVARIANT, SHUTDOWN, KvCommand, KvOp, ResultHeader, RunHeader, Tag
from ..transport.mpi_link import Backoff, Link, RankFailedError, WaitPolicy
from ..decode.cpu_account import PROCESS, STAGE, WAIT
from ..decode.metrics import now
from ..decode.sampling import SamplingParams, sample_rows, to_spec
from ..decode.result import RankReport
from ..decode.pipeline_protocol import RunResult  # noqa: F401 - part of this module's API

PipelineError = RankFailedError  # a rank of the job failed; the message names the rank


@dataclass
class PipelineCounters:
    """The head's share of one request, as the pipeline counted it (`Pipeline.take_counters`)."""

    busy_s: float  # seconds the head computed its layers
    rows_requested: int  # rows whose sampled token was asked for
    kv_at_start: int | None  # the head's KV cells in use when the request began (None: it did not begin)


class Pipeline:
    def __init__(self, link: Link | None, engine, n_stages: int, trace, draft_rank: int | None = None,
                 wait_policy: WaitPolicy | None = None):
        """link: to the other ranks (None on one rank: the head waits only for its own draft thread);
        wait_policy: how to wait without a link (the head passes its link's; default: plain sleeps)."""
        self.link, self.engine, self.n_stages, self.trace = link, engine, n_stages, trace
        self.wait_policy = wait_policy if wait_policy is not None else WaitPolicy()
        self.draft_rank = draft_rank
        self.next_run_id = 1
        self.last_result_id = 0  # results arrive in launch order: the next one is for run last_result_id + 1
        self.ready: deque[RunResult] = deque()  # results already received, oldest first
        self.busy_s = 0.0
        self.rows_requested = 0  # rows whose sampled token was asked for (this request)
        self.sampling = SamplingParams()
        self.kv_at_start: int | None = None  # KV cells in use when this request began

    def take_counters(self) -> PipelineCounters:
        """This request's counters; the next request counts from zero."""
        c = PipelineCounters(self.busy_s, self.rows_requested, self.kv_at_start)
        self.busy_s, self.rows_requested, self.kv_at_start = 0.0, 0, None
        return c

    def set_sampling(self, params: SamplingParams) -> None:
        """How the rows of the runs launched from now on are sampled (sent in stream order)."""
        self.sampling = params
        self.kv_at_start = self.engine.kv_used_cells()  # every request starts here, after the last clear
        if self.n_stages > 1:
            self.link.send_array(to_spec(params).encode(), 1, Tag.STREAM)

    # -- runs ------------------------------------------------------------------------------
    def launch(self, tokens: list[int], pos: list[int], seq_ids: list[list[int]], output: list[bool],
               speculative: bool = False, invariant: bool = True) -> int:
        """Compute the head's layers for a batch and send it down the pipe; return its run id.

        invariant: every stage computes each row exactly as a one-token batch would, so a token
        verified in a batch gets the very logits plain decoding gives it (lossless speculation).
        Only prompt processing, which is the same in every mode, turns it off for speed.
        """
        run_id = self.next_run_id
        self.next_run_id += 1
        self.rows_requested += int(np.count_nonzero(output))
        hdr = RunHeader(run_id, np.asarray(pos, np.int32), seq_ids, np.asarray(output, bool), speculative=speculative,
                        flags=RUN_FLAG_INVARIANT if invariant else 0)
        t0 = now()
        with self.link.computing() if self.link is not None else contextlib.nullcontext(), PROCESS.charge(STAGE):
            out = self.engine.eval(tokens=np.asarray(tokens, np.int32), pos=hdr.pos, seq_ids=seq_ids,
                                   output=hdr.output if self.n_stages == 1 else None, batch_invariant=invariant)
            if self.n_stages == 1:
                out = sample_rows(out, self.sampling, hdr.pos[hdr.output] + 1)
        t1 = now()
        self.busy_s += t1 - t0
        self.trace.slice("stage", t0, t1, run=run_id, n_tokens=len(tokens), spec=speculative)
        if self.n_stages == 1:
            self.ready.append(RunResult(run_id, out))
            self.last_result_id = run_id
        else:
            head = hdr.encode()
            self.link.send_array(head, 1, Tag.STREAM)
            self.link.send_array(out, 1, Tag.PAYLOAD)
            self.trace.instant("send", now(), run=run_id, to=1, bytes=head.nbytes + out.nbytes)
        return run_id

    def kv(self, cmd: KvCommand) -> None:
        """Apply a KV operation here and on every stage, in stream order behind earlier runs."""
        cmd.apply(self.engine)
        if self.n_stages > 1:
            self.link.send_array(cmd.encode(), 1, Tag.STREAM)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        self.kv(KvCommand(KvOp.SEQ_RM, seq, p0, p1))

    def seq_cp(self, src: int, dsts: list[int], p0: int = -1, p1: int = -1) -> None:
        self.kv(KvCommand(KvOp.SEQ_CP, src, p0, p1, list(dsts)))

    def kv_clear(self) -> None:
        self.kv(KvCommand(KvOp.CLEAR))

    def cancel(self, run_ids: list[int]) -> None:
        """Tell every stage directly (not hop by hop) to drop these runs."""
        if self.n_stages > 1 and run_ids:
            ids = np.asarray(run_ids, np.int64)
            for r in range(1, self.n_stages):
                self.link.send_array(ids, r, Tag.CANCEL)
        self.trace.instant("cancel", now(), runs=list(run_ids))

    # -- results ---------------------------------------------------------------------------
    def poll(self) -> bool:
        """Receive every result that has arrived, without waiting. True if any arrived."""
        if self.n_stages == 1:
            return bool(self.ready)
        self.check_errors()
        got = False
        last = self.n_stages - 1
        while (st := self.link.probe(last, Tag.RESULT)) is not None:
            hdr = ResultHeader.decode(self.link.recv_array(last, Tag.RESULT, np.int64, st))
            tokens = None
            if hdr.has_data:
                tokens = self.link.recv_array(last, Tag.RESULT_DATA, np.int64)
            elif not hdr.cancelled:  # asked for no rows (a prompt chunk before the last)
                tokens = np.empty(0, np.int64)
            self._check_order(hdr.run_id, last)
            self.ready.append(RunResult(hdr.run_id, tokens))
            got = True
        self.link.progress_sends()
        return got

    def _check_order(self, run_id: int, last: int) -> None:
        """Every run launched gives exactly one result, in launch order: anything else is a stray
        (a duplicated or late result) or a loss, never a token to print."""
        want = self.last_result_id + 1
        if run_id != want or run_id >= self.next_run_id:
            raise PipelineError(f"{self.link.names[last]} returned the result of run {run_id} where run {want} was "
                                f"expected: a message was lost or duplicated on the way")
        self.last_result_id = run_id

    def awaiting(self) -> tuple[int, Tag] | None:
        """The (rank, tag) the head waits for now: a result while runs are in flight, else a draft reply."""
        if self.last_result_id + 1 < self.next_run_id:
            return self.n_stages - 1, Tag.RESULT
        return (self.draft_rank, Tag.DRAFT_REP) if self.draft_rank is not None else None

    def next_result(self) -> RunResult:
        """Wait (without spinning) for the oldest outstanding result. Results arrive in launch order."""
        backoff = self._backoff(site="result")
        with PROCESS.charge(WAIT):
            while not self.ready:
                if self.poll():
                    break
                if self.link is not None:
                    self.link.idle(backoff, awaiting=self.awaiting())
                else:
                    backoff.idle()
        backoff.reset()  # records how long this wait lasted
        return self.ready.popleft()

    def wait_until(self, cond) -> None:
        """Sleep (with backoff, never spinning) until cond() is true; cond polls what it waits for.
        A failure another rank reported is raised, and sends keep moving while waiting. These waits
        (a result or a draft reply) are one wait site of the link's history, so that a wait as long
        as the recent ones is slept through rather than probed ten thousand times a second."""
        backoff = self._backoff(site="result-or-draft")
        with PROCESS.charge(WAIT):
            while not cond():
                if self.link is None:
                    backoff.idle()
                    continue
                self.link.raise_reported_error()
                self.link.progress_sends()
                self.link.idle(backoff, awaiting=self.awaiting())

    def _backoff(self, **kwargs) -> Backoff:
        """A Backoff with the link's wait policy and history, or (one rank) this pipeline's policy."""
        return self.link.backoff(**kwargs) if self.link is not None else Backoff(self.wait_policy, **kwargs)

    def check_errors(self) -> None:
        if self.link is not None:
            self.link.raise_reported_error()

    # -- between requests and at the end ------------------------------------------------------
    def report(self) -> list[RankReport]:
        """Collect every other rank's counters and trace events (in stream order, after all runs)."""
        return self._ask_everyone(REPORT)

    def kv_usage(self) -> dict[int, int]:
        """KV cells in use on every rank (the draft rank: tokens in its model's cache), in stream
        order: after the KV operations sent so far."""
        usage = {0: self.engine.kv_used_cells()}
        for r in self._ask_everyone(KV_USAGE):
            usage[r.rank] = r.cells
        return usage

    def _ask_everyone(self, msg) -> list:
        """Send a control message down the stream (and to the draft rank); one pickled reply per rank."""
        if self.link is None:
            return []
        if self.n_stages > 1:
            self.link.send_array(msg, 1, Tag.STREAM)
        if self.draft_rank is not None:
            self.link.send_array(msg, self.draft_rank, Tag.DRAFT_REQ)
        others = list(range(1, self.n_stages)) + ([self.draft_rank] if self.draft_rank is not None else [])
        return [self.link.recv_pickled(r, Tag.STATS, on_idle=self.check_errors) for r in others]

    def shutdown(self) -> None:
        """Stop the other ranks' loops (heartbeats first: the ranks stop listening)."""
        if self.link is None:
            return
        liveness = self.link.liveness
        if liveness is not None:
            liveness.stop()
        if self.n_stages > 1:
            self.link.send_array(SHUTDOWN, 1, Tag.STREAM)
        if self.draft_rank is not None:
            self.link.send_array(SHUTDOWN, self.draft_rank, Tag.DRAFT_REQ)
        self.link.flush()
        if liveness is not None:
            liveness.await_farewells()
