"""A pipeline in virtual time: the `PipelineLike` that `pipeinfer plan` runs the real decoding
policies against.

Discrete events, as the real job does them:
- `launch` computes the head's layers in the head's own time (the head is busy meanwhile: that is
  how the real head works) and sends the run on;
- every further stage takes runs in launch order, each busy until its previous run is done;
  hidden states cross a link as its latency plus bytes over its bandwidth;
- a cancel goes from the head to every stage directly: a stage that has not started the run skips
  it (its fixed cost only), one that is computing it stops at the next layer;
- the last stage samples and sends token ids back to the head;
- the head's own bookkeeping: its measured fixed cost per run (`run_overhead_s`: launch, result,
  commit of one token, as calibrate times its iterative loop) is in the head's part of every run,
  and a speculative run's result that the head takes (it verifies the drafted tokens, commits the
  accepted ones, cancels what they invalidate) costs it that fixed cost once more
  (`HEAD_COMMIT_RUNS`), computed on the head's host like its layers.

Ranks of one host compute at their measured speed while their threads fit its usable CPUs; when
they could outnumber them, every computation goes through `planner/shared_cores.py` (processor
sharing, event by event) instead of the closed-form schedule here, with the same figures wherever
nothing contends.

Virtual time moves only when the head waits (`next_result`, `wait_until`), computes (`launch`) or
drafts (the replay drafter advances it). The KV cache, the sampled tokens and the operation log
are the `VirtualPipeline`'s, so a policy's KV mistake shows here as in the tests.
"""

from __future__ import annotations

import math

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..decode.pipeline_protocol import RunResult
from ..decode.virtual_pipeline import VirtualPipeline
from .costs import StageCost
from .profile import LinkCosts, RankCosts
from .shared_cores import HEADER_BYTES, CoreSim, SimRun, Task, core_sim
MAX_WAITS = 1_000_000
# The head's work on a speculative run's result (verify, commit, cancel), in units of its measured
# fixed cost per run: an estimate (calibrate times the iterative loop, whose runs commit one token
# and cancel nothing), charged per result taken; planner/split.py charges it per commit likewise.
HEAD_COMMIT_RUNS = 1.0


@dataclass
class _Run:
    run_id: int
    rows: int
    n_out: int
    kv: int
    invariant: bool
    sampled: np.ndarray
    t_sent: float  # the head has computed its layers and sent the run on
    speculative: bool = False  # it carries drafted tokens: its result costs the head a commit
    t_cancel: float | None = None
    arrival: float = 0.0  # result at the head (recomputed as runs are launched and cancelled)
    starts: list[float] = field(default_factory=list)  # per stage >= 1: when it takes the run
    ends: list[float] = field(default_factory=list)  # per stage >= 1: when it is done with the run
    computed: list[bool] = field(default_factory=list)  # per stage >= 1: it computed (not skipped)


class SimulatedPipeline(VirtualPipeline):
    """stages[0] is the head; links[i] carries stage i -> i+1, links[-1] the last stage -> head;
    cancel_links[i]: head -> stage i (cancel messages go directly). token_of(context, pos): the token
    the target gives after a row (a replayed trace)."""

    def __init__(self, stages: list[StageCost], links: list[LinkCosts], cancel_links: list[LinkCosts],
                 n_embd: int, token_of: Callable[[tuple[int, ...], int], int], n_seq_max: int, n_ctx: int,
                 draft_rank: RankCosts | None = None, draft_threads: int | None = None,
                 shared_cores: bool | None = None):
        super().__init__(logits_of=None, latency=0, n_seq_max=n_seq_max, n_ctx=n_ctx)
        self.stages, self.links, self.cancel_links = stages, links, cancel_links
        self.n_stages = len(stages)
        self.n_embd = n_embd
        self.token_of = token_of
        self.t = 0.0
        self.inflight: list[_Run] = []
        self.free_at = [0.0] * len(stages)  # per stage >= 1: done with every delivered run
        self.busy_s = [0.0] * len(stages)  # per stage: seconds computing (skips included)
        self.event_sources: list[Callable[[], float | None]] = []  # e.g. a draft rank's reply time
        self.draft_free = 0.0  # a draft rank is busy until then (when no host is shared)
        self.draft_span: dict[int, tuple[float, float]] = {}  # its jobs' start and end (idem)
        self.draft_threads = draft_threads
        # Ranks whose threads together exceed their host's usable CPUs compute slower when they
        # compute at once: then every computation goes through the hosts' CPU model (shared_cores.py);
        # otherwise the closed-form schedule below, the same figures without the events.
        sim = core_sim(self, draft_rank, draft_threads)
        self.sim: CoreSim | None = sim if (shared_cores if shared_cores is not None else sim.oversubscribed()) else None
        self.jobs = 0
        self.predicted: dict[tuple[str, int], float | None] = {}  # CoreSim: each task's end, as now foreseen

    # -- time ---------------------------------------------------------------------------------
    def clock(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    def row_token(self, context: tuple[int, ...], pos: int) -> int:
        return self.token_of(context, pos)

    # -- runs ---------------------------------------------------------------------------------
    def launch(self, tokens: list[int], pos: list[int], seq_ids: list[list[int]], output: list[bool],
               speculative: bool = False, invariant: bool = True) -> int:
        run_id = super().launch(tokens, pos, seq_ids, output, speculative, invariant)
        sampled = self.ready.pop().tokens  # the base class answers at once; here the answer travels
        rows, n_out, kv = len(tokens), int(np.count_nonzero(output)), int(max(pos)) + 1
        head = self.stages[0].run_seconds(rows, n_out if self.n_stages == 1 else 0, kv, invariant)
        if self.sim is None:
            self.busy_s[0] += head
            self.t += head
        else:
            self.sim.run(before=self.t)
            self.sim.launch(run_id, SimRun(rows, n_out, kv, invariant), self.t, head)
            end = self._foresee(("head", run_id))
            self.busy_s[0] += head if end == self.t + head else end - self.t  # unstretched: the same sum
            self.t = end
        if self.n_stages == 1:
            self.ready.append(RunResult(run_id, sampled))
            if speculative:
                self._commit_work()
            return run_id
        self.inflight.append(_Run(run_id, rows, n_out, kv, invariant, sampled, self.t, speculative))
        self._schedule()
        return run_id

    def cancel(self, run_ids: list[int]) -> None:
        super().cancel(run_ids)
        ids = set(run_ids)
        if self.sim is not None:
            self.sim.run(before=self.t)
        for r in self.inflight:
            if r.run_id in ids and r.t_cancel is None:
                r.t_cancel = self.t
                if self.sim is not None:
                    self.sim.cancel(r.run_id, self.t)
        self._schedule()

    # -- computations besides the runs ----------------------------------------------------------
    def _commit_work(self) -> None:
        """The head verifies and commits a speculative run's result (HEAD_COMMIT_RUNS)."""
        seconds = HEAD_COMMIT_RUNS * self.stages[0].costs.run_overhead_s
        if seconds > 0:
            self.busy_s[0] += seconds
            self.head_compute(seconds, None)

    def head_compute(self, seconds: float, threads: int | None) -> None:
        """The head computes something else (a draft model's evals; threads None: the head's own)
        for `seconds` alone."""
        if self.sim is None:
            self.t += seconds
            return
        self.jobs += 1
        self.sim.run(before=self.t)
        self.sim.add(0, Task("compute", self.jobs, self.t, seconds, threads=threads))
        self.t = self._foresee(("compute", self.jobs))

    def draft_job(self, arrive: float, seconds: float) -> tuple[int, Callable[[], float]]:
        """A draft rank's job that reaches it at `arrive`: its id, and a function that gives when it
        is done, as now foreseen (another rank of its host computing meanwhile delays it)."""
        self.jobs += 1
        if self.sim is None:
            start = max(arrive, self.draft_free)
            end = self.draft_free = start + seconds
            self.draft_span[self.jobs] = (start, end)
            return self.jobs, lambda: end
        key = ("draft", self.jobs)
        self.sim.run(before=self.t)
        self.sim.add(self.n_stages, Task("draft", self.jobs, arrive, seconds))
        self._schedule()
        return self.jobs, lambda: self.predicted[key]

    def draft_leave(self, job: int, arrive: float, quantum: float) -> None:
        """The draft rank leaves job `job` (a stream of tokens of `quantum` seconds) when a newer
        request reaches it at `arrive`: not started, it never runs; under way, it ends with the token
        in progress (shared_cores.CoreSim.leave, the same arithmetic)."""
        if self.sim is not None:
            self.sim.run(before=self.t)
            self.sim.leave(job, arrive, quantum)
            self._schedule()
            return
        start, end = self.draft_span.get(job, (arrive, arrive))
        if arrive >= end or job != self.jobs:
            return  # over, or another job came after it (its successor's start is fixed already)
        if arrive <= start:
            self.draft_free = start
        elif quantum > 0:
            self.draft_free = min(end, start + quantum * math.ceil((arrive - start) / quantum - 1e-12))

    def _foresee(self, key: tuple[str, int]) -> float:
        """When a task of the head's ends, with nothing new from the head meanwhile (it is busy)."""
        look = self.sim.clone()
        look.run(until=lambda sim: sim.tasks[key].end is not None)
        return look.tasks[key].end

    def _schedule(self) -> None:
        """Every run in flight through stages 1.., in launch order, from what is known now. Past
        events never change: a cancel arrives after the moment it was sent."""
        if self.sim is not None:
            self._foresee_all()
            return
        free = list(self.free_at)
        for r in self.inflight:
            r.starts, r.ends, r.computed = [], [], []
            t, payload = r.t_sent, True
            for s in range(1, self.n_stages):
                t += self.links[s - 1].seconds(HEADER_BYTES + (r.rows * self.n_embd * 4 if payload else 0))
                stage = self.stages[s]
                start = max(t, free[s])
                full = stage.run_seconds(r.rows, r.n_out if s == self.n_stages - 1 else 0, r.kv, r.invariant)
                cancel_at = None if r.t_cancel is None else r.t_cancel + self.cancel_links[s].seconds(8)
                if not payload or (cancel_at is not None and cancel_at <= start):
                    end, payload = start + stage.costs.run_overhead_s, False
                elif cancel_at is not None and cancel_at < start + full:
                    end, payload = min(start + full, cancel_at + stage.layer_seconds(r.rows, r.kv, r.invariant)), False
                else:
                    end = start + full
                free[s] = end
                r.starts.append(start)
                r.ends.append(end)
                r.computed.append(payload)
                t = end
            n_back = r.n_out if payload else 0
            r.arrival = t + self.links[-1].seconds(HEADER_BYTES + 8 * n_back)

    def _foresee_all(self) -> None:
        """Every run in flight and every job, through the hosts' CPU model, from what is known now."""
        self.sim.forget(r.run_id for r in self.inflight)
        look = self.sim.clone()
        look.run()
        self.predicted.update((key, task.end) for key, task in look.tasks.items())
        for r in self.inflight:
            sr = look.runs[r.run_id]
            r.starts, r.ends, r.computed, r.arrival = sr.starts, sr.ends, sr.computed, sr.arrival

    def poll(self) -> bool:
        got = False
        while self.inflight and self.inflight[0].arrival <= self.t:
            r = self.inflight.pop(0)
            for s, (start, end) in enumerate(zip(r.starts, r.ends), start=1):
                self.busy_s[s] += end - start
                self.free_at[s] = end
            cancelled = r.t_cancel is not None or not r.computed[-1]
            self.ready.append(RunResult(r.run_id, None if cancelled else r.sampled))
            got = True
            if r.speculative and not cancelled:
                self._commit_work()
        return got

    def next_event(self) -> float | None:
        times = [r.arrival for r in self.inflight[:1]] + [t for src in self.event_sources if (t := src()) is not None]
        return min(times) if times else None

    def next_result(self) -> RunResult:
        while not self.ready:
            if not self.inflight:
                raise RuntimeError("the policy waits for a result with no run in flight")
            self.t = max(self.t, self.inflight[0].arrival)
            self.poll()
        return self.ready.popleft()

    def wait_until(self, cond: Callable[[], bool], max_checks: int = MAX_WAITS) -> None:
        for _ in range(max_checks):
            if cond():
                return
            t = self.next_event()
            if t is None:
                raise RuntimeError("the policy waits with nothing in flight: it would wait for ever")
            self.t = max(self.t, t)
        raise RuntimeError("the policy kept waiting without progress")

    def utilisation(self) -> list[float]:
        """Per stage, the share of the elapsed virtual time it spent computing."""
        return [b / self.t if self.t > 0 else 0.0 for b in self.busy_s]
