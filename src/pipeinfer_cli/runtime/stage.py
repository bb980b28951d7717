"""A target stage (rank >= 1): take runs from the previous rank in stream order, compute this rank's
layers, pass hidden states on (or, from the last stage, the sampled token of each requested row
back to the head).

A listener thread takes CANCEL and ABORT messages from the head while the main thread computes,
so a cancelled run is aborted between layers mid-compute. While the main thread waits for its
stream it polls them itself, between its own probes, and the listener sleeps: two pollers would
double an idle rank's wake-ups, and every wake-up is paid out of the host's CPU (a capped host's
quota above all). A cancelled run is dropped before it starts either way.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from ..native import EvalCancelled
from ..transport.messages import (
    RUN_FLAG_INVARIANT, RUN_FLAG_SKIP, KvCommand, Msg, ResultHeader, RunHeader, SamplingSpec, Tag,
)
from ..transport.mpi_link import Link
from ..decode.cpu_account import PROCESS, STAGE, WAIT
from ..decode.metrics import now
from ..decode.sampling import SamplingParams, from_spec, sample_rows
from .rank_report import JobAborted, KvUsage, RankReporter, fault_injection

if TYPE_CHECKING:
    from ..decode.trace import TraceRecorder
    from ..native import LayerEngine
    from .weight_stream import LoadedWeights


LISTENER_HI_S = 2e-3  # the longest sleep between the listener's probes while its stage computes
LISTENER_IDLE_S = 0.5  # while the stage waits, the listener only wakes this often to see if it must stop


class CancelListener(threading.Thread):
    """Receives the head's CANCEL(run ids) and ABORT, directly, while the stage computes; while the
    stage waits for its stream, its main thread receives them (`poll`) and this thread sleeps."""

    def __init__(self, link: Link, engine):
        super().__init__(daemon=True, name="cancel-listener")
        self.link, self.engine = link, engine
        self.lock = threading.Lock()
        self.poll_lock = threading.Lock()  # one thread at a time probes and receives CANCEL
        self.cancelled: set[int] = set()
        self.current: int | None = None  # run id being computed right now
        self.computing = threading.Event()  # set from begin() to end(): the listener polls
        self.aborted = threading.Event()
        self.stopped = threading.Event()
        self.failure: Exception | None = None  # what ended the listener, if not an ABORT

    def run(self) -> None:
        try:
            self._listen()
        except Exception as exc:  # noqa: BLE001 - e.g. a lost CANCEL: the main loop raises it
            self.failure = exc
            self.aborted.set()
            self.engine.cancel()

    def stop(self) -> None:
        self.stopped.set()
        self.computing.set()  # wake it, so that it sees stopped at once

    def _listen(self) -> None:
        # a steady probe every LISTENER_HI_S while computing: no burst of short sleeps at the start
        # of each run, which would take the compute's CPU on a capped host
        backoff = self.link.backoff(lo=LISTENER_HI_S, hi=LISTENER_HI_S, hot_hi=LISTENER_HI_S)
        while not self.stopped.is_set() and not self.aborted.is_set():
            if not self.computing.is_set():
                self.computing.wait(LISTENER_IDLE_S)
                backoff.reset()
            elif self.poll():
                backoff.reset()
            else:
                backoff.idle()

    def poll(self) -> bool:
        """Receive the CANCELs that arrived (cancelling the run being computed if it is among them)
        and notice an ABORT; True if a CANCEL arrived. Called by the listener while the stage
        computes, and by the stage's main thread while it waits for its stream and before a run."""
        with self.poll_lock:
            progressed = False
            while (st := self.link.probe(0, Tag.CANCEL)) is not None:
                ids = self.link.recv_array(0, Tag.CANCEL, np.int64, st)
                with self.lock:
                    self.cancelled.update(int(i) for i in ids)
                    if self.current is not None and self.current in self.cancelled:
                        self.engine.cancel()
                progressed = True
            if not self.aborted.is_set() and self.link.abort_requested():
                self.aborted.set()
                self.engine.cancel()
            return progressed

    def begin(self, run_id: int) -> bool:
        """Mark run_id as computing, the listener polling from now on; False if it was already
        cancelled (then skip it)."""
        self.poll()  # a CANCEL sent just after the run's header is not missed
        with self.lock:
            self.engine.clear_cancel()
            if run_id in self.cancelled:
                return False
            self.current = run_id
        self.computing.set()
        return True

    def end(self, run_id: int) -> None:
        self.computing.clear()
        with self.lock:
            self.current = None
            # Run ids increase along the stream: older ids can never arrive again.
            self.cancelled = {i for i in self.cancelled if i > run_id}


def serve_stage(link: Link, engine: LayerEngine, threads: int, trace: TraceRecorder,
                weights: LoadedWeights | None = None) -> None:
    """Run the stage loop until SHUTDOWN, reporting this request's counters to the head at each REPORT."""
    listener = CancelListener(link, engine)
    listener.start()
    try:
        _StageLoop(link, engine, threads, trace, listener, weights).run()
        link.flush()
    finally:
        listener.stop()
        # The listener probes MPI: it must be gone before the interpreter finalizes MPI at exit (a
        # probe during MPI_Finalize can crash the rank after a job that succeeded).
        listener.join(timeout=5)


class _StageLoop:
    """One stage's stream: control messages (KV, SAMPLING, REPORT, KV_USAGE, SHUTDOWN) and runs, in order."""

    def __init__(self, link: Link, engine, threads: int, trace, listener: CancelListener, weights: dict | None = None):
        self.link, self.engine, self.trace, self.listener = link, engine, trace, listener
        self.prev = link.rank - 1
        self.is_last = engine.is_last
        self.nxt = None if self.is_last else link.rank + 1
        self.fail_at = fault_injection(link)
        self.n_runs = 0  # over the whole job, for fault injection
        self.report = RankReporter(link.rank, "stage", [engine.layer_begin, engine.layer_end], threads, trace, engine, link,
                                 weights)
        self.sampling = SamplingParams()  # set by the head at the start of every request (Msg.SAMPLING)
        self.skipped_before_start = 0  # runs cancelled before this stage started them (this request)
        self.layers_unstarted = 0  # their layers

    def run(self) -> None:
        link, backoff = self.link, self.link.backoff(site="stream")
        while True:
            msg = self.next_message(backoff)
            kind = int(msg[0])
            if kind == Msg.RUN:
                self.run_one(RunHeader.decode(msg))
                continue
            if self.nxt is not None:  # control messages pass down the stream in order
                link.send_array(msg, self.nxt, Tag.STREAM)
            if kind == Msg.SHUTDOWN:
                if link.liveness is not None:
                    link.liveness.stop(farewell=True)
                return
            self.control(kind, msg)

    def next_message(self, backoff) -> np.ndarray:
        """The stream's next message, waited for without spinning (charged to WAIT once per wait,
        not at every wake-up: a charge costs a few microseconds itself)."""
        st = self._probe()
        if st is None:
            with PROCESS.charge(WAIT):
                while (st := self._probe()) is None:
                    self.link.progress_sends()
                    self.listener.poll()
                    self.link.idle(backoff)
        backoff.reset()
        return self.link.recv_array(self.prev, Tag.STREAM, np.int64, st)

    def _probe(self):
        if self.listener.aborted.is_set():
            raise self.listener.failure or JobAborted()
        return self.link.probe(self.prev, Tag.STREAM)

    def control(self, kind: int, msg: np.ndarray) -> None:
        if kind == Msg.KV:
            KvCommand.decode(msg).apply(self.engine)
        elif kind == Msg.SAMPLING:  # the start of a request: the previous one's KV clear came before
            self.sampling = from_spec(SamplingSpec.decode(msg))
            self.report.kv_at_start = self.engine.kv_used_cells()
        elif kind == Msg.REPORT:
            out = self.report.take(skipped_before_start=self.skipped_before_start)
            out.engine["layer_evals_skipped"] = out.engine.get("layer_evals_skipped", 0) + self.layers_unstarted
            self.skipped_before_start = self.layers_unstarted = 0
            self.link.send_pickled(out, 0, Tag.STATS)
        elif kind == Msg.KV_USAGE:
            self.link.send_pickled(KvUsage(self.link.rank, self.engine.kv_used_cells()), 0, Tag.STATS)

    def run_one(self, hdr: RunHeader) -> None:
        engine = self.engine
        payload = None
        if not hdr.flags & RUN_FLAG_SKIP:
            payload = self.link.recv_array(self.prev, Tag.PAYLOAD, np.float32).reshape(hdr.n_tokens, engine.n_embd)
        self.n_runs += 1
        self.report.runs += 1
        if self.fail_at is not None and self.n_runs >= self.fail_at:
            raise RuntimeError(f"injected fault (PIPEINFER_DEBUG_FAULT) on run {hdr.run_id}")
        out = None
        if payload is not None and self.listener.begin(hdr.run_id):
            with self.link.computing():
                out = _compute(engine, hdr, payload, self.is_last, self.report, self.trace)
            self.listener.end(hdr.run_id)
        elif payload is not None:
            self.skipped_before_start += 1
            self.layers_unstarted += engine.layer_end - engine.layer_begin
            self.trace.instant("skip", now(), run=hdr.run_id)
        if out is not None and self.is_last:
            with PROCESS.charge(STAGE):
                out = sample_rows(out, self.sampling, hdr.pos[hdr.output] + 1)
        _forward(self.link, hdr, out, self.nxt, self.trace)


def _compute(engine, hdr: RunHeader, payload: np.ndarray, is_last: bool, report: RankReporter, trace):
    """This stage's layers for one run; None if it was cancelled while computing."""
    t0 = now()
    try:
        with PROCESS.charge(STAGE):
            out = engine.eval(embd=payload, pos=hdr.pos, seq_ids=hdr.seq_ids, output=hdr.output if is_last else None,
                              batch_invariant=bool(hdr.flags & RUN_FLAG_INVARIANT))
    except EvalCancelled:
        out = None
    t1 = now()
    report.busy_s += t1 - t0
    trace.slice("stage", t0, t1, run=hdr.run_id, n_tokens=hdr.n_tokens, spec=hdr.speculative, cancelled=out is None)
    return out


def _forward(link: Link, hdr: RunHeader, out, nxt: int | None, trace) -> None:
    """Hidden states to the next stage, or (last stage) the sampled tokens back to the head. A
    cancelled run still passes its header on, so every stage sees the stream in the same order.
    A 'send' instant in the trace marks each transfer (destination and bytes)."""
    if out is None:
        hdr.flags |= RUN_FLAG_SKIP
    if nxt is None:
        result = ResultHeader(hdr.run_id, 0 if out is None else len(out), cancelled=out is None)
        msgs = [result.encode()] + ([out] if result.has_data else [])
        link.send_array(msgs[0], 0, Tag.RESULT)
        if result.has_data:
            link.send_array(out, 0, Tag.RESULT_DATA)
        to = 0
    else:
        msgs = [hdr.encode()] + ([out] if out is not None else [])
        link.send_array(msgs[0], nxt, Tag.STREAM)
        if out is not None:
            link.send_array(out, nxt, Tag.PAYLOAD)
        to = nxt
    trace.instant("send", now(), run=hdr.run_id, to=to, bytes=sum(m.nbytes for m in msgs))
