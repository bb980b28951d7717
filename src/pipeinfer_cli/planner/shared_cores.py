"""Ranks that share a host's cores, in virtual time: an event-driven model of each host's CPU.

Calibration times every rank alone (the others asleep), so a rank's measured seconds are its
seconds with the CPU to itself. When several ranks of one host compute at once with more threads
than the host's usable CPUs, each computation stretches: processor sharing, every computation on
the host advancing at usable / threads busy of its own speed (never faster than alone), the rate
recomputed whenever a computation on that host starts or ends. A host whose quota is below one
rank's threads (a container of half a CPU) slowed that rank in its calibration already: alone, it
runs at its measured speed (HostCPU.share). An idle rank does not compete
(ranks sleep while they wait). A host whose threads never exceed its CPUs runs every computation
at its measured speed.

`HostCPU` is that arithmetic; `CoreSim` moves the runs of a `SimulatedPipeline` through its
workers (the head, the stages, a draft rank) with it, as the closed-form schedule of
`planner/sim_pipeline.py` does when nothing shares: in launch order through every stage, a
cancel skipping or stopping a run as there. The pipeline clones the simulation to look ahead
(when will this run's result reach the head?) and advances its own copy only up to the head's
present, where the head's next launch, cancel or draft request changes the future.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol


class StagedPipeline(Protocol):
    """What the host CPU model reads of the simulated pipeline (planner/sim_pipeline.py, which
    imports this module): its stages' costs, the links between them and the row width."""

    stages: list
    links: list
    cancel_links: list
    n_stages: int
    n_embd: int


HEADER_BYTES = 64  # a run header or a result header on the wire (ids, flags, positions)


@dataclass
class Computation:
    """One computation under way: `remaining` seconds of its work alone, as of `base_t`."""

    threads: int
    remaining: float
    base_t: float
    rate: float = 1.0  # share of its own speed it runs at now
    task: Task | None = None

    @property
    def end(self) -> float:
        # with the host to itself (rate 1, never rebased) this is start + work, exactly
        return self.base_t + self.remaining / self.rate


class HostCPU:
    """One host's usable CPUs, shared by the computations under way on it."""

    def __init__(self, usable: float):
        self.usable = usable
        self.running: list[Computation] = []

    def start(self, t: float, c: Computation) -> None:
        c.base_t, c.rate = t, 1.0
        self.running.append(c)
        self._rerate(t)

    def finish(self, t: float, c: Computation) -> None:
        self.running.remove(c)
        self._rerate(t)

    def share(self, threads: int, busy: int) -> float:
        """A computation's speed against its calibrated one while `busy` threads compute on the
        host. Calibration ran it alone on min(threads, usable) CPUs (a quota below its threads
        had already slowed it: that is in its measured seconds, not to be charged twice); shared,
        it gets usable × threads / busy of them."""
        if busy <= 0:
            return 1.0
        return min(1.0, self.usable * threads / busy / min(threads, self.usable))

    def _rerate(self, t: float) -> None:
        busy = sum(c.threads for c in self.running)
        for c in self.running:
            rate = self.share(c.threads, busy)
            if c.rate != rate:  # only a change of rate rebases: an unshared computation keeps start + work
                c.remaining -= (t - c.base_t) * c.rate
                c.base_t, c.rate = t, rate


@dataclass
class Task:
    """Work waiting for (or done by) a worker: the head's layers of a run ("head"), a stage's part
    of a run ("stage"), a head computation without a run ("compute"), a draft rank's job ("draft")."""

    kind: str
    key: int  # run id, or job id
    ready: float  # when it has reached the worker
    work: float = 0.0  # seconds alone (a stage's is decided when it starts: computed or skipped)
    payload: bool = True  # a stage: the run's hidden states came with it (not skipped upstream)
    threads: int | None = None  # a head computation with other threads than the head's (a draft's); None: the worker's
    start: float | None = None
    end: float | None = None


@dataclass
class SimRun:
    rows: int
    n_out: int
    kv: int
    invariant: bool
    t_cancel: float | None = None
    arrival: float | None = None  # the result at the head
    starts: list[float] = field(default_factory=list)  # per stage >= 1
    ends: list[float] = field(default_factory=list)
    computed: list[bool] = field(default_factory=list)


@dataclass
class Worker:
    host: str
    threads: int
    queue: list[Task] = field(default_factory=list)  # in the order it takes them
    busy: Computation | None = None


class CoreSim:
    """Workers 0..n_stages-1 are the pipeline's stages (0: the head), a draft rank is worker n_stages.
    `pipe` is the SimulatedPipeline whose stages, links and cancel links it reads (never changes)."""

    def __init__(self, pipe: StagedPipeline, hosts: list[str], threads: list[int], usable: dict[str, float]):
        self.pipe = pipe
        self.workers = [Worker(h, n) for h, n in zip(hosts, threads)]
        self.cpus = {h: HostCPU(u) for h, u in usable.items()}
        self.runs: dict[int, SimRun] = {}
        self.tasks: dict[tuple[str, int], Task] = {}
        self.cancels: list[tuple[float, int, int]] = []  # (arrives, run id, stage)
        self.leaves: list[tuple[float, int, float]] = []  # (arrives, draft job id, quantum): see leave
        self.now = 0.0
        self.head_draft_threads: int | None = None  # a draft model on the head computes with these

    def clone(self) -> CoreSim:
        """A copy to look ahead with (the pipeline's costs shared, every moving part copied)."""
        new = copy.copy(self)
        tasks: dict[int, Task] = {}
        comps: dict[int, Computation] = {}

        def task(t: Task) -> Task:
            if id(t) not in tasks:
                tasks[id(t)] = copy.copy(t)
            return tasks[id(t)]

        def comp(c: Computation) -> Computation:
            if id(c) not in comps:
                comps[id(c)] = copy.copy(c)
                comps[id(c)].task = task(c.task)
            return comps[id(c)]

        new.tasks = {k: task(t) for k, t in self.tasks.items()}
        new.workers = [Worker(w.host, w.threads, [task(t) for t in w.queue], w.busy and comp(w.busy))
                       for w in self.workers]
        new.cpus = {}
        for h, cpu in self.cpus.items():
            new.cpus[h] = HostCPU(cpu.usable)
            new.cpus[h].running = [comp(c) for c in cpu.running]
        new.runs = {k: SimRun(r.rows, r.n_out, r.kv, r.invariant, r.t_cancel, r.arrival, list(r.starts),
                              list(r.ends), list(r.computed)) for k, r in self.runs.items()}
        new.cancels = list(self.cancels)
        new.leaves = list(self.leaves)
        return new

    # -- inputs, at the head's present ----------------------------------------------------------
    def add(self, worker: int, task: Task) -> None:
        self.tasks[task.kind, task.key] = task
        self.workers[worker].queue.append(task)

    def launch(self, run_id: int, run: SimRun, t: float, head_work: float) -> None:
        self.runs[run_id] = run
        self.add(0, Task("head", run_id, t, head_work))

    def cancel(self, run_id: int, t: float) -> None:
        r = self.runs.get(run_id)
        if r is None or r.t_cancel is not None:
            return
        r.t_cancel = t
        self.cancels += [(t + self.pipe.cancel_links[s].seconds(8), run_id, s) for s in range(1, self.pipe.n_stages)]

    def leave(self, job: int, t: float, quantum: float) -> None:
        """At t, the draft rank leaves its job `job` (a stream of tokens, quantum seconds each): not
        started, it is dropped; under way, it ends with the token in progress."""
        self.leaves.append((t, job, quantum))

    # -- time ---------------------------------------------------------------------------------
    def run(self, before: float | None = None, until: Callable[[CoreSim], bool] | None = None) -> None:
        """Process events in time order: those before `before`, or until `until(self)` holds, or all."""
        while not (until is not None and until(self)):
            t = self._next_time()
            if t is None or (before is not None and t >= before):
                return
            self.now = t
            self._ends(t)
            self._cancels(t)
            self._leaves(t)
            self._starts(t)

    def _next_time(self) -> float | None:
        times = [c.end for cpu in self.cpus.values() for c in cpu.running]
        times += [w.queue[0].ready for w in self.workers if w.busy is None and w.queue]
        times += [c[0] for c in self.cancels] + [x[0] for x in self.leaves]
        return min(times) if times else None

    def _ends(self, t: float) -> None:
        for i, w in enumerate(self.workers):
            c = w.busy
            if c is not None and c.end <= t:
                self.cpus[w.host].finish(t, c)
                w.busy = None
                c.task.end = t
                self._done(i, c.task, t)

    def _cancels(self, t: float) -> None:
        due = [c for c in self.cancels if c[0] <= t]
        self.cancels = [c for c in self.cancels if c[0] > t]
        for _, run_id, s in due:
            c = self.workers[s].busy
            task = c.task if c is not None else None
            if task is None or task.kind != "stage" or task.key != run_id or not task.payload:
                continue  # not computing that run: it skips it when it takes it
            task.payload = False
            r = self.runs[run_id]
            stopped = t + self.pipe.stages[s].layer_seconds(r.rows, r.kv, r.invariant) / c.rate
            if stopped < c.end:  # it stops at the next layer
                c.remaining = self.pipe.stages[s].layer_seconds(r.rows, r.kv, r.invariant)
                c.base_t = t

    def _leaves(self, t: float) -> None:
        due = [x for x in self.leaves if x[0] <= t]
        self.leaves = [x for x in self.leaves if x[0] > t]
        for _, job, quantum in due:
            task = self.tasks.get(("draft", job))
            if task is None or task.end is not None:
                continue
            c = self.workers[-1].busy
            if c is None or c.task is not task:
                task.work = 0.0  # not started: dropped
                continue
            done_at_base = task.work - c.remaining
            done = done_at_base + (t - c.base_t) * c.rate
            total = quantum * math.ceil(done / quantum - 1e-12) if quantum > 0 else done
            if total < task.work:
                c.remaining = total - done_at_base

    def _starts(self, t: float) -> None:
        for i, w in enumerate(self.workers):
            if w.busy is not None or not w.queue or w.queue[0].ready > t:
                continue
            task = w.queue.pop(0)
            if task.kind == "stage":
                self._decide(i, task, t)
            task.start = t
            c = Computation(task.threads or w.threads, task.work, t, task=task)
            w.busy = c
            self.cpus[w.host].start(t, c)

    def _decide(self, s: int, task: Task, t: float) -> None:
        """A stage takes a run: it computes it, or skips it (its fixed cost only) when the run was
        stopped upstream or its cancel is already here."""
        r, stage = self.runs[task.key], self.pipe.stages[s]
        cancel_at = None if r.t_cancel is None else r.t_cancel + self.pipe.cancel_links[s].seconds(8)
        if not task.payload or (cancel_at is not None and cancel_at <= t):
            task.work, task.payload = stage.costs.run_overhead_s, False
        else:
            task.work = stage.run_seconds(r.rows, r.n_out if s == self.pipe.n_stages - 1 else 0, r.kv, r.invariant)

    def _done(self, worker: int, task: Task, t: float) -> None:
        if task.kind == "head" and self.pipe.n_stages > 1:
            self._send(task.key, 1, t, True)
        elif task.kind == "stage":
            r = self.runs[task.key]
            r.starts.append(task.start)
            r.ends.append(t)
            r.computed.append(task.payload)
            self._send(task.key, worker + 1, t, task.payload)

    def _send(self, run_id: int, s: int, t: float, payload: bool) -> None:
        """The run leaves stage s - 1 at t: on to stage s, or (after the last) its result to the head."""
        p, r = self.pipe, self.runs[run_id]
        if s < p.n_stages:
            ready = t + p.links[s - 1].seconds(HEADER_BYTES + (r.rows * p.n_embd * 4 if payload else 0))
            self.add(s, Task("stage", run_id, ready, payload=payload))
        else:
            r.arrival = t + p.links[-1].seconds(HEADER_BYTES + 8 * (r.n_out if payload else 0))

    # -- bookkeeping ----------------------------------------------------------------------------
    def forget(self, inflight: Iterable[int]) -> None:
        """Drop what is over (runs whose result reached the head, finished tasks): a look ahead
        copies what is left."""
        keep = set(inflight)
        self.runs = {k: r for k, r in self.runs.items() if r.arrival is None or k in keep}
        self.tasks = {k: t for k, t in self.tasks.items() if t.end is None}

    def oversubscribed(self) -> bool:
        """Some host's ranks, all computing at once, would have more threads than its usable CPUs."""
        need: dict[str, int] = {}
        for i, w in enumerate(self.workers):
            threads = max(w.threads, self.head_draft_threads or 0) if i == 0 else w.threads
            need[w.host] = need.get(w.host, 0) + threads
        return any(n > self.cpus[h].usable for h, n in need.items())


def usable_cpus(rc) -> float:
    """The CPU a rank's process may use, as calibrate recorded it (its host's logical CPUs in an
    older profile)."""
    return float(rc.usable_cpus if rc.usable_cpus is not None else rc.cores)


def core_sim(pipe: StagedPipeline, draft_rank=None, draft_threads: int | None = None) -> CoreSim:
    """The CPU model of a pipeline's hosts: a worker per stage (and the draft rank, if any), each on
    its profile rank's host with the threads it was measured with; a host's usable CPUs are the
    least any of its ranks recorded."""
    ranks = [s.costs for s in pipe.stages] + ([draft_rank] if draft_rank is not None else [])
    threads = [s.costs.threads for s in pipe.stages]
    if draft_rank is not None:
        threads.append(draft_threads or draft_rank.threads)
    usable: dict[str, float] = {}
    for rc in ranks:
        usable[rc.host] = min(usable.get(rc.host, float("inf")), usable_cpus(rc))
    sim = CoreSim(pipe, [rc.host for rc in ranks], threads, usable)
    sim.head_draft_threads = draft_threads if draft_rank is None else None
    return sim


def unmodelled(ranks: list[tuple[int, str, int, float]]) -> str | None:
    """Why a job whose ranks compute at once cannot be predicted this way, or None. ranks: (rank,
    host, threads, usable CPUs) of each rank of the job. Processor sharing is what the kernel does
    to ranks of one thread; ranks of several threads on too few CPUs are worse off than that (a
    rank's threads meet at every operation, and one preempted thread holds up the others), by an
    amount the planner cannot know. So: several ranks of one host, more threads than its CPUs, any
    of them with more than one thread."""
    by_host: dict[str, list[tuple[int, int, float]]] = {}
    for rank, host, threads, usable in ranks:
        by_host.setdefault(host, []).append((rank, threads, usable))
    for host, rs in by_host.items():
        total, usable = sum(t for _, t, _ in rs), min(u for _, _, u in rs)
        if len(rs) > 1 and total > usable and any(t > 1 for _, t, _ in rs):
            names = ", ".join(str(r) for r, _, _ in rs)
            threads = "/".join(str(t) for _, t, _ in rs)
            return (f"ranks {names} compute at once on {host} with {threads} threads, {total} threads on its "
                    f"{usable:g} usable CPUs: the planner models ranks of one thread sharing cores, not ranks "
                    f"of several threads that wait on each other's preempted threads; calibrate and run with "
                    f"--threads 1, or with fewer ranks on {host}")
    return None
