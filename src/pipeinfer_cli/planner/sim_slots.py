"""Parallel requests in virtual time: the slots of one simulated pipeline, and the threads that
take turns on it.

`serve --parallel N` runs each request in a thread of its own on a `SlotPipeline`
(runtime/slot_pipeline.py): the slot's sequence ids and cells, its runs interleaved with the other
slots' in the stages, results handed to the slot that launched the run, the load policy asked
before a speculative run. `SimSlot` is that view over one `SimulatedPipeline`, so the decoding
policies run unchanged on it, N at once.

The policies block (they wait for results), so each request runs in a thread here too, but only
one thread runs at a time (`TurnTaking`): the one whose wait is satisfied at the current virtual
time, the longest waiting first; when no wait is, virtual time moves to the next arrival. A turn
ends only at a wait, so the result is deterministic, and the head's work (its layers, drafting)
is serial on one clock, as in the real head process.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace

from ..decode.parallel_policy import may_speculate
from ..decode.pipeline_protocol import RunResult
from ..decode.sampling import SamplingParams
from ..decode.slot_geometry import SlotGeometry
from .sim_pipeline import SimulatedPipeline

MAX_TURNS_AT_ONE_TIME = 1_000_000  # turns without virtual time moving: a policy that never waits for it


class _Stop(BaseException):
    """Raised in a waiting thread when the simulation ends early (another thread failed)."""


class _Turn:
    def __init__(self, name: str, body: Callable[[], None]):
        self.name, self.body = name, body
        self.thread: threading.Thread | None = None
        self.done = False
        self.since = (0.0, 0)  # (virtual time, order) its current wait began: the longest waiting goes first
        self.progressed = False  # in its last turn it got past a wait (or started)


class TurnTaking:
    """Threads that run one at a time, in the virtual time of `sim` (the module doc)."""

    def __init__(self, sim: SimulatedPipeline):
        self.sim = sim
        self._cv = threading.Condition()
        self._running: _Turn | None = None
        self._turns: list[_Turn] = []
        self._order = 0
        self._stopping = False
        self._current = threading.local()
        self.error: BaseException | None = None
        self.pump: Callable[[], None] = lambda: None  # hands arrived results to their slots

    def spawn(self, name: str, body: Callable[[], None]) -> None:
        """A thread that runs body() when its turn first comes (now, or after the running one waits)."""
        self._order += 1
        turn = _Turn(name, body)
        turn.since = (self.sim.t, self._order)
        self._turns.append(turn)

    def wait_until(self, cond: Callable[[], bool]) -> None:
        """In a thread of this simulation: return once cond() holds, letting the others run meanwhile."""
        if cond():
            return
        turn = self._current.turn
        self._order += 1  # a new wait: it queues behind those waiting already
        turn.since = (self.sim.t, self._order)
        while True:
            self._hand_back(turn)
            if cond():
                turn.progressed = True
                return

    def run(self) -> None:
        """Run every thread (and those they spawn) to its end; raise the first failure."""
        at_this_time, t = 0, self.sim.t
        while not self._stopping and any(not x.done for x in self._turns):
            self.pump()
            ready = sorted((x for x in self._turns if not x.done), key=lambda x: x.since)
            if any(self._give(x) for x in ready):
                at_this_time = at_this_time + 1 if self.sim.t == t else 0
                t = self.sim.t
                if at_this_time > MAX_TURNS_AT_ONE_TIME:
                    self._fail(RuntimeError("the policies kept running without virtual time moving"))
                continue
            nxt = self.sim.next_event()
            if nxt is None or nxt <= self.sim.t:
                self._fail(RuntimeError("every request waits and nothing is in flight: they would wait for ever"))
                break
            self.sim.t = nxt
        self._finish()
        if self.error is not None:
            raise self.error

    # -- the hand-over ---------------------------------------------------------------------------
    def _give(self, turn: _Turn) -> bool:
        """Let `turn` run until it waits again or ends; whether it got past a wait (or started or ended)."""
        with self._cv:
            self._running = turn
            turn.progressed = turn.thread is None
            if turn.thread is None:
                turn.thread = threading.Thread(target=self._body, args=(turn,), name=turn.name, daemon=True)
                turn.thread.start()
            self._cv.notify_all()
            while self._running is turn:
                self._cv.wait()
        return turn.progressed or turn.done

    def _hand_back(self, turn: _Turn) -> None:
        with self._cv:
            self._running = None
            self._cv.notify_all()
            while self._running is not turn:
                self._cv.wait()
            if self._stopping:
                raise _Stop()

    def _body(self, turn: _Turn) -> None:
        self._current.turn = turn
        with self._cv:
            while self._running is not turn:
                self._cv.wait()
        try:
            turn.body()
        except _Stop:
            pass
        except BaseException as exc:  # noqa: BLE001 - re-raised by run()
            self._fail(exc)
        finally:
            turn.done = True
            with self._cv:
                self._running = None
                self._cv.notify_all()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._stopping = True

    def _finish(self) -> None:
        """Wake every thread still waiting, so that it stops (after a failure)."""
        for turn in self._turns:
            if turn.thread is not None and not turn.done:
                with self._cv:
                    self._running = turn
                    self._cv.notify_all()
                    while self._running is turn and not turn.done:
                        self._cv.wait(0.1)


class SlotMux:
    """The slots of one simulated pipeline (runtime/slot_pipeline.PipelineMux's part, in virtual time)."""

    def __init__(self, sim: SimulatedPipeline, geometry: SlotGeometry, load_policy: str, turns: TurnTaking):
        self.sim, self.geometry, self.load_policy, self.turns = sim, geometry, load_policy, turns
        self.owner: dict[int, SimSlot] = {}  # run id -> the slot that launched it
        self.active: set[int] = set()  # slots generating
        self.views = [SimSlot(self, i) for i in range(geometry.n_slots)]
        turns.pump = self.pump

    def pump(self) -> None:
        """Take every arrived result and hand it to the slot that launched its run."""
        self.sim.poll()
        while self.sim.ready:
            res = self.sim.ready.popleft()
            view = self.owner.pop(res.run_id)
            view.inflight -= 1
            view.ready.append(res)

    def may_speculate(self) -> bool:
        inflight = [self.views[i].inflight for i in sorted(self.active)]
        return may_speculate(self.load_policy, inflight, self.sim.n_stages)


class SimSlot:
    """A PipelineLike over one KV slot of the simulated pipeline (runtime/slot_pipeline.SlotPipeline's
    counterpart). token_of(pos): the token the target gives after a row of this slot's request."""

    def __init__(self, mux: SlotMux, index: int):
        self.mux, self.index = mux, index
        sim, g = mux.sim, mux.geometry
        self.n_stages, self.trace, self.clock = sim.n_stages, sim.trace, sim.clock
        self.engine = SimpleNamespace(n_seq_max=g.seqs_per_slot, n_ctx=g.cells_per_slot)
        self.ready: deque[RunResult] = deque()
        self.inflight = 0
        self.sampling = SamplingParams()
        self.token_of: Callable[[int], int] = lambda pos: 0

    def _seq(self, s: int) -> int:
        return self.mux.geometry.engine_seq(self.index, s)

    def set_sampling(self, params: SamplingParams) -> None:
        self.sampling = params

    def launch(self, tokens: list[int], pos: list[int], seq_ids: list[list[int]], output: list[bool],
               speculative: bool = False, invariant: bool = True) -> int:
        sim = self.mux.sim
        sim.token_of = lambda _context, p: self.token_of(p)  # the rows sampled at launch are this slot's
        run_id = sim.launch(tokens, pos, [[self._seq(s) for s in row] for row in seq_ids], output,
                            speculative=speculative, invariant=invariant)
        self.mux.owner[run_id] = self
        self.inflight += 1
        self.mux.pump()  # one stage: the result is there already
        return run_id

    def seq_cp(self, src: int, dsts: list[int], p0: int = -1, p1: int = -1) -> None:
        self.mux.sim.seq_cp(self._seq(src), [self._seq(d) for d in dsts], p0, p1)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        self.mux.sim.seq_rm(self._seq(seq), p0, p1)

    def cancel(self, run_ids: list[int]) -> None:
        self.mux.sim.cancel(run_ids)

    def may_speculate(self) -> bool:
        return self.mux.may_speculate()

    def poll(self) -> bool:
        self.mux.pump()
        return bool(self.ready)

    def next_result(self) -> RunResult:
        self.wait_until(self.poll)
        return self.ready.popleft()

    def wait_until(self, cond: Callable[[], bool]) -> None:
        self.mux.turns.wait_until(cond)
