"""A target stage (rank >= 1): take runs from the previous rank in stream order, compute this rank's
layers, pass hidden states on (or logits back to the head from the last stage).

A listener thread takes CANCEL and ABORT messages from the head while the main thread computes,
so a cancelled run is dropped before it starts or aborted between layers mid-compute.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from ..native import EvalCancelled
from ..transport.messages import RUN_FLAG_INVARIANT, RUN_FLAG_SKIP, KvCommand, Msg, RunHeader, Tag, result_header
from ..transport.mpi_link import Backoff, Link
from .metrics import now, peak_rss_mib


class JobAborted(Exception):
    """The head told this rank to stop because the job failed elsewhere."""


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
            if self.link.probe(0, Tag.ABORT) is not None:
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


def fault_injection(rank: int):
    """PIPEINFER_DEBUG_FAIL=RANK:N makes rank RANK raise on its N-th run (a stage), draft proposal (the
    draft rank) or committed token (the head, rank 0), to test fault handling."""
    spec = os.environ.get("PIPEINFER_DEBUG_FAIL", "")
    if not spec:
        return None
    r, _, n = spec.partition(":")
    return int(n or 1) if int(r) == rank else None


def rank_report(rank: int, role: str, layers, threads: int, busy_s: float, cpu0: float, trace, **extra) -> dict:
    """This rank's counters and the trace events since the last report (sent to the head).

    cpu_s counts CPU seconds since the rank started serving (after loading), so an idle rank that
    spins would show it."""
    events = list(trace.events)
    trace.events.clear()
    return {"rank": rank, "role": role, "layers": layers, "threads": threads,
            "peak_rss_mib": round(peak_rss_mib(), 1), "busy_s": round(busy_s, 4),
            "cpu_s": round(time.process_time() - cpu0, 3), **extra, "trace": events}


def _engine_counters(engine, layers_unstarted: int) -> dict:
    """The engine's counters, where layer_evals_skipped also counts the runs dropped before they started."""
    stats = dict(engine.stats())
    stats["layer_evals_skipped"] = stats.get("layer_evals_skipped", 0) + layers_unstarted
    return stats


def serve_stage(link: Link, engine, threads: int, trace) -> None:
    """Run the stage loop until SHUTDOWN, reporting counters to the head at each REPORT."""
    rank, prev = link.rank, link.rank - 1
    is_last = engine.is_last
    nxt = None if is_last else rank + 1
    listener = CancelListener(link, engine)
    listener.start()
    fail_at = fault_injection(rank)
    n_runs = 0
    busy_s = 0.0
    skipped_before_start = 0
    layers_unstarted = 0  # layers of runs cancelled before this stage started them
    backoff = Backoff()
    cpu0 = time.process_time()
    try:
        while True:
            if listener.aborted.is_set():
                raise JobAborted()
            st = link.probe(prev, Tag.STREAM)
            if st is None:
                link.progress_sends()
                backoff.idle()
                continue
            backoff.reset()
            msg = link.recv_array(prev, Tag.STREAM, np.int64, st)
            kind = int(msg[0])
            if kind in (Msg.SHUTDOWN, Msg.REPORT):
                if nxt is not None:
                    link.send_array(msg, nxt, Tag.STREAM)
                if kind == Msg.SHUTDOWN:
                    break
                link.send_object(rank_report(rank, "stage", [engine.layer_begin, engine.layer_end], threads, busy_s, cpu0, trace,
                                             runs=n_runs, skipped_before_start=skipped_before_start,
                                             engine=_engine_counters(engine, layers_unstarted),
                                             kv_used_cells=engine.kv_used_cells()), 0, Tag.STATS)
                continue
            if kind == Msg.KV:
                KvCommand.decode(msg).apply(engine)
                if nxt is not None:
                    link.send_array(msg, nxt, Tag.STREAM)
                continue
            hdr = RunHeader.decode(msg)
            payload = None
            if not hdr.flags & RUN_FLAG_SKIP:
                payload = link.recv_array(prev, Tag.PAYLOAD, np.float32).reshape(hdr.n_tokens, engine.n_embd)
            n_runs += 1
            if fail_at is not None and n_runs >= fail_at:
                raise RuntimeError(f"injected fault (PIPEINFER_DEBUG_FAIL) on run {hdr.run_id}")
            out = None
            if payload is not None and listener.begin(hdr.run_id):
                t0 = now()
                try:
                    out = engine.eval(embd=payload, pos=hdr.pos, seq_ids=hdr.seq_ids,
                                      output=hdr.output if is_last else None,
                                      batch_invariant=bool(hdr.flags & RUN_FLAG_INVARIANT))
                except EvalCancelled:
                    out = None
                t1 = now()
                busy_s += t1 - t0
                trace.slice("stage", t0, t1, run=hdr.run_id, n_tokens=hdr.n_tokens, spec=hdr.speculative,
                            cancelled=out is None)
                listener.end(hdr.run_id)
            elif payload is not None:
                skipped_before_start += 1
                layers_unstarted += engine.layer_end - engine.layer_begin
                trace.instant("skip", now(), run=hdr.run_id)
            if out is None:
                hdr.flags |= RUN_FLAG_SKIP
            if is_last:
                link.send_array(result_header(hdr.run_id, 0 if out is None else len(out), out is None), 0, Tag.LOGITS)
                if out is not None and len(out):  # a prompt chunk before the last asks for no rows
                    link.send_array(out, 0, Tag.LOGITS_DATA)
            else:
                link.send_array(hdr.encode(), nxt, Tag.STREAM)
                if out is not None:
                    link.send_array(out, nxt, Tag.PAYLOAD)
        link.flush()
    finally:
        listener.stopped.set()
