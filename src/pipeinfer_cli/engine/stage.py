"""A target stage (rank >= 1): take runs from the previous rank in stream order, compute this rank's
layers, pass hidden states on (or, from the last stage, the sampled token of each requested row
back to the head).

A listener thread takes CANCEL and ABORT messages from the head while the main thread computes,
so a cancelled run is dropped before it starts or aborted between layers mid-compute.
"""

from __future__ import annotations

import threading

import numpy as np

from ..native import EvalCancelled
from ..transport.messages import (
    RUN_FLAG_INVARIANT, RUN_FLAG_SKIP, KvCommand, Msg, ResultHeader, RunHeader, SamplingSpec, Tag,
)
from ..transport.mpi_link import Backoff, Link
from .metrics import now
from .sampling import SamplingParams, from_spec, sample_rows
from .worker import JobAborted, RankReport, fault_injection


class CancelListener(threading.Thread):
    """Receives the head's CANCEL(run ids) and ABORT, directly, while the stage computes."""

    def __init__(self, link: Link, engine):
        super().__init__(daemon=True, name="cancel-listener")
        self.link, self.engine = link, engine
        self.lock = threading.Lock()
        self.cancelled: set[int] = set()
        self.current: int | None = None  # run id being computed right now
        self.aborted = threading.Event()
        self.stopped = threading.Event()

    def run(self) -> None:
        backoff = Backoff(hi=2e-3)
        while not self.stopped.is_set():
            progressed = False
            st = self.link.probe(0, Tag.CANCEL)
            if st is not None:
                ids = self.link.recv_array(0, Tag.CANCEL, np.int64, st)
                with self.lock:
                    self.cancelled.update(int(i) for i in ids)
                    if self.current is not None and self.current in self.cancelled:
                        self.engine.cancel()
                progressed = True
            if self.link.abort_requested():
                self.aborted.set()
                self.engine.cancel()
                return
            if progressed:
                backoff.reset()
            else:
                backoff.idle()

    def begin(self, run_id: int) -> bool:
        """Mark run_id as computing; False if it was already cancelled (then skip it)."""
        with self.lock:
            self.engine.clear_cancel()
            if run_id in self.cancelled:
                return False
            self.current = run_id
            return True

    def end(self, run_id: int) -> None:
        with self.lock:
            self.current = None
            # Run ids increase along the stream: older ids can never arrive again.
            self.cancelled = {i for i in self.cancelled if i > run_id}


def serve_stage(link: Link, engine, threads: int, trace) -> None:
    """Run the stage loop until SHUTDOWN, reporting this request's counters to the head at each REPORT."""
    rank, prev = link.rank, link.rank - 1
    is_last = engine.is_last
    nxt = None if is_last else rank + 1
    listener = CancelListener(link, engine)
    listener.start()
    fail_at = fault_injection(rank)
    n_runs = 0  # over the whole job, for fault injection
    report = RankReport(rank, "stage", [engine.layer_begin, engine.layer_end], threads, trace, engine, link)
    sampling = SamplingParams()  # set by the head at the start of every request (Msg.SAMPLING)
    skipped_before_start = 0  # runs cancelled before this stage started them (this request)
    layers_unstarted = 0  # their layers
    backoff = Backoff()
    try:
        while True:
            if listener.aborted.is_set():
                raise JobAborted()
            st = link.probe(prev, Tag.STREAM)
            if st is None:
                link.progress_sends()
                link.idle(backoff)
                continue
            backoff.reset()
            msg = link.recv_array(prev, Tag.STREAM, np.int64, st)
            kind = int(msg[0])
            if kind in (Msg.SHUTDOWN, Msg.REPORT):
                if nxt is not None:
                    link.send_array(msg, nxt, Tag.STREAM)
                if kind == Msg.SHUTDOWN:
                    break
                out = report.take(skipped_before_start=skipped_before_start)
                out["engine"]["layer_evals_skipped"] = out["engine"].get("layer_evals_skipped", 0) + layers_unstarted
                skipped_before_start = layers_unstarted = 0
                link.send_pickled(out, 0, Tag.STATS)
                continue
            if kind in (Msg.KV, Msg.SAMPLING):
                if kind == Msg.KV:
                    KvCommand.decode(msg).apply(engine)
                else:
                    sampling = from_spec(SamplingSpec.decode(msg))
                if nxt is not None:
                    link.send_array(msg, nxt, Tag.STREAM)
                continue
            hdr = RunHeader.decode(msg)
            payload = None
            if not hdr.flags & RUN_FLAG_SKIP:
                payload = link.recv_array(prev, Tag.PAYLOAD, np.float32).reshape(hdr.n_tokens, engine.n_embd)
            n_runs += 1
            report.runs += 1
            if fail_at is not None and n_runs >= fail_at:
                raise RuntimeError(f"injected fault (PIPEINFER_DEBUG_FAIL) on run {hdr.run_id}")
            out = None
            if payload is not None and listener.begin(hdr.run_id):
                out = _compute(engine, hdr, payload, is_last, report, trace)
                listener.end(hdr.run_id)
            elif payload is not None:
                skipped_before_start += 1
                layers_unstarted += engine.layer_end - engine.layer_begin
                trace.instant("skip", now(), run=hdr.run_id)
            if out is not None and is_last:
                out = sample_rows(out, sampling, hdr.pos[hdr.output] + 1)
            _forward(link, hdr, out, nxt)
        link.flush()
    finally:
        listener.stopped.set()


def _compute(engine, hdr: RunHeader, payload: np.ndarray, is_last: bool, report: RankReport, trace):
    """This stage's layers for one run; None if it was cancelled while computing."""
    t0 = now()
    try:
        out = engine.eval(embd=payload, pos=hdr.pos, seq_ids=hdr.seq_ids, output=hdr.output if is_last else None,
                          batch_invariant=bool(hdr.flags & RUN_FLAG_INVARIANT))
    except EvalCancelled:
        out = None
    t1 = now()
    report.busy_s += t1 - t0
    trace.slice("stage", t0, t1, run=hdr.run_id, n_tokens=hdr.n_tokens, spec=hdr.speculative, cancelled=out is None)
    return out


def _forward(link: Link, hdr: RunHeader, out, nxt: int | None) -> None:
    """Hidden states to the next stage, or (last stage) the sampled tokens back to the head. A
    cancelled run still passes its header on, so every stage sees the stream in the same order."""
    if out is None:
        hdr.flags |= RUN_FLAG_SKIP
    if nxt is None:
        result = ResultHeader(hdr.run_id, 0 if out is None else len(out), cancelled=out is None)
        link.send_array(result.encode(), 0, Tag.RESULT)
        if result.has_data:
            link.send_array(out, 0, Tag.RESULT_DATA)
    else:
        link.send_array(hdr.encode(), nxt, Tag.STREAM)
        if out is not None:
            link.send_array(out, nxt, Tag.PAYLOAD)
