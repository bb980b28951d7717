"""One pipeline shared by parallel requests: each request's thread talks to its own `SlotPipeline`.

A `SlotPipeline` is a `PipelineLike` for one KV slot, so every decoding mode runs unchanged on it:
its sequence ids 0..k-1 are the slot's ids on the engine (the slot's canonical sequence is the
mode's sequence 0), its context is the slot's share of cells, and its results are the results of
the runs it launched. The `PipelineMux` owns the real `Pipeline`: it serialises every MPI call and
engine call of the slots' threads behind one lock, sends a slot's sampling settings down the stream
before its runs when another slot's were sent last, and hands each arrived result to the slot that
launched the run. Runs of different requests follow each other through the stages, so while one
request's run is on stage 2 another's is on stage 1.

Waiting never spins: a thread that waits for its result polls under the lock, then sleeps one
backoff step without it (the pipeline's wait policy).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..decode.parallel_policy import may_speculate
from ..decode.pipeline_protocol import RunResult
from ..decode.sampling import SamplingParams
from ..decode.slot_geometry import SlotGeometry
from .pipeline import Pipeline, PipelineCounters


class MuxFailed(RuntimeError):
    """Another slot's thread hit a failure of the job: this slot stops too."""


@dataclass
class SlotEngine:
    """What the modes read of the engine (`pipe.engine`): a slot's sequences and cells."""

    n_seq_max: int
    n_ctx: int
    engine: object

    def kv_used_cells(self) -> int:
        return self.engine.kv_used_cells()


class PipelineMux:
    def __init__(self, pipe: Pipeline, n_slots: int, load_policy: str = "yield"):
        eng = pipe.engine
        self.pipe, self.n_slots, self.load_policy = pipe, n_slots, load_policy
        self.geometry = SlotGeometry.of_engine(eng.n_seq_max, eng.n_ctx, n_slots)
        self.lock = threading.RLock()
        self.owner: dict[int, SlotPipeline] = {}  # run id -> the slot that launched it
        self.sent_sampling: SamplingParams | None = None
        self.active: set[int] = set()  # slots generating
        self.error: BaseException | None = None
        self.views = [SlotPipeline(self, i) for i in range(n_slots)]

    def may_speculate(self) -> bool:
        with self.lock:
            inflight = [self.views[i].inflight for i in sorted(self.active)]
            return may_speculate(self.load_policy, inflight, self.pipe.n_stages)

    def fail(self, exc: BaseException) -> None:
        """A slot's thread failed: every other slot's wait raises MuxFailed."""
        with self.lock:
            if self.error is None:
                self.error = exc

    def pump(self) -> None:
        """Take every arrived result and hand it to its slot (under the lock)."""
        if self.error is not None:
            raise MuxFailed(f"the job failed: {self.error}")
        pipe = self.pipe
        pipe.poll()
        while pipe.ready:
            res = pipe.ready.popleft()
            view = self.owner.pop(res.run_id)
            view.inflight -= 1
            view.ready.append(res)

    def idle_check(self) -> None:
        """Read heartbeats while no slot waits (the service's idle check)."""
        with self.lock:
            link = self.pipe.link
            if link is not None and link.liveness is not None:
                link.liveness.check()


class SlotPipeline:
    """A PipelineLike over one KV slot of a shared pipeline (see the module docstring)."""

    def __init__(self, mux: PipelineMux, index: int):
        self.mux, self.index = mux, index
        pipe = mux.pipe
        self.n_stages, self.trace = pipe.n_stages, pipe.trace
        self.engine = SlotEngine(mux.geometry.seqs_per_slot, mux.geometry.cells_per_slot, pipe.engine)
        self.ready: deque[RunResult] = deque()
        self.inflight = 0  # runs launched whose result has not arrived
        self.sampling = SamplingParams()
        self.busy_s = 0.0
        self.rows_requested = 0
        self.kv_at_start: int | None = None
        self._backoff = pipe._backoff(site=f"slot-{index}")

    # -- the slot's sequences ----------------------------------------------------------------
    def _seq(self, s: int) -> int:
        return self.mux.geometry.engine_seq(self.index, s)

    # -- PipelineLike ----------------------------------------------------------------------
    def set_sampling(self, params: SamplingParams) -> None:
        self.sampling = params
        with self.mux.lock:
            self.kv_at_start = self.mux.pipe.engine.kv_used_cells()

    def launch(self, tokens: list[int], pos: list[int], seq_ids: list[list[int]], output: list[bool],
               speculative: bool = False, invariant: bool = True) -> int:
        mapped = [[self._seq(s) for s in row] for row in seq_ids]
        mux = self.mux
        with mux.lock:
            if mux.error is not None:
                raise MuxFailed(f"the job failed: {mux.error}")
            pipe = mux.pipe
            if mux.sent_sampling is not self.sampling:
                pipe.set_sampling(self.sampling)  # in stream order, before this slot's run
                mux.sent_sampling = self.sampling
            busy0 = pipe.busy_s
            run_id = pipe.launch(tokens, pos, mapped, output, speculative=speculative, invariant=invariant)
            self.busy_s += pipe.busy_s - busy0
            self.rows_requested += int(np.count_nonzero(output))
            mux.owner[run_id] = self
            self.inflight += 1
            mux.pump()  # one stage: the result is there already
        return run_id

    def seq_cp(self, src: int, dsts: list[int], p0: int = -1, p1: int = -1) -> None:
        with self.mux.lock:
            self.mux.pipe.seq_cp(self._seq(src), [self._seq(d) for d in dsts], p0, p1)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        with self.mux.lock:
            self.mux.pipe.seq_rm(self._seq(seq), p0, p1)

    def cancel(self, run_ids: list[int]) -> None:
        with self.mux.lock:
            self.mux.pipe.cancel(run_ids)

    def may_speculate(self) -> bool:
        """The load policy's answer for a speculative run of this slot (decode/parallel_policy.py)."""
        return self.mux.may_speculate()

    def poll(self) -> bool:
        with self.mux.lock:
            self.mux.pump()
        return bool(self.ready)

    def next_result(self) -> RunResult:
        self.wait_until(lambda: bool(self.ready))
        return self.ready.popleft()

    def wait_until(self, cond: Callable[[], bool]) -> None:
        """Poll under the lock, sleep one backoff step without it, until cond() holds. The slot's
        waits are one wait site of the link's history, so a predictable wait is slept through
        (transport/waits.py) instead of probed every 100 us: on a host whose cores the stages use,
        probing would take their CPU."""
        mux = self.mux
        backoff = self._backoff
        while True:
            with mux.lock:
                mux.pump()
                if cond():
                    backoff.reset()  # records how long this wait lasted
                    return
                pipe = mux.pipe
                link = pipe.link
                if link is not None:
                    link.raise_reported_error()
                    link.progress_sends()
                    if link.liveness is not None:
                        link.liveness.check(pipe.awaiting(), since=backoff.idle_since)
            backoff.idle()

    def take_counters(self) -> PipelineCounters:
        c = PipelineCounters(self.busy_s, self.rows_requested, self.kv_at_start)
        self.busy_s, self.rows_requested, self.kv_at_start = 0.0, 0, None
        return c
