"""A generation job on every rank: carry out its plan, load once, run each request on the head,
serve elsewhere.

A job runs one or more requests (prompt + mode) on models loaded once, so `bench` can interleave
modes on the same ranks. Where each part lives:

- the plan (who computes what, planner/job_plan.py) is made before the job starts, by the command
  (cli/job_setup.py); the head hands it to every rank (`weight_stream.py`), with the threads of
  its host (`topology.py`); `loading.py` loads it (`Loaded`);
- `head.py` runs the requests on rank 0 (`pipeline.py` talks to the stages, `decode_*.py` are
  the modes, `session.py` the committed tokens);
- `stage.py` and `remote_draft.py` serve the other ranks; `worker.py` is the fault protocol and
  the per-request report every rank sends the head.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import describe
from ..transport.clock import clock_offsets
from ..transport.liveness import Liveness
from ..transport.mpi_link import Link
from ..transport.start_waits import start_timeout_s
from ..transport.startup import job_startup
from ..decode.result import GenerationResult
from .head import Callbacks, Head, serve_requests
from ..planner.job_config import JobConfig  # noqa: F401 - part of this module's API
from .job_config import Request  # noqa: F401 - part of this module's API
from .loaded import Loaded
from .cpu_share import cpu_share
from .loading import load_rank
from ..decode.modes import MODE_NAMES as MODES, needs_draft as needs_draft_for  # noqa: F401 - MODES is part of this module's API
from ..planner.job_plan import JobPlan, layout_of
from ..planner.layout import Topology
from .topology import alone_on_cores, default_threads
from .weight_stream import LoadedWeights, WeightsSource, local_files, share_plan_and_weights
from ..decode.trace import TraceRecorder
from .worker import abort_job, serve_worker


def run_job(plan: JobPlan | JobConfig, requests: list[Request], on_start: Callable[[object], None] | None = None,
            on_token: Callable[[int], None] | None = None,
            on_result: Callable[[GenerationResult], None] | None = None,
            on_text: Callable[[str], None] | None = None) -> list[GenerationResult] | None:
    """Run on every rank of COMM_WORLD. Returns one result per request on the head, None elsewhere.
    plan: the job's plan (a bare JobConfig: the head lays it out as its requests need, _as_plan).

    on_start(tokenizer) is called on the head once the models are loaded; on_token(token) as each
    token is committed; on_text(text) with the text to show as tokens are committed (UTF-8
    completed, stop strings held back and cut); on_result(result) after each request.
    """
    if isinstance(plan, JobConfig):
        draft_model = plan.draft.uses_model
        plan = _as_plan(plan, any(needs_draft_for(r.mode) or (r.trace_depth and draft_model) for r in requests))
    link = job_startup().link
    job = _load_job(link, plan, requests)
    if link.rank != 0:
        _serve_as_worker(link, job)
        return None
    return serve_requests(link, job.cfg, job.loaded, job.trace, zip(requests, job.loaded.prompts), job.offsets,
                          Callbacks(on_start, on_token, on_text, on_result))


def run_service(plan: JobPlan | JobConfig, service, before_load: Callable[[], None] | None = None) -> None:
    """Run on every rank of COMM_WORLD: the head answers a `service.Service`'s requests, one at a
    time, until service.stop(); the other ranks serve the pipeline. The draft (if any) is loaded,
    so that each request may choose its mode.

    before_load() runs on the head before the models load (e.g. to start answering "loading");
    an error it raises ends the job like a failed load. Returns once the job is over; a rank's
    failure is raised on the head after service.fail() told every waiting client.
    """
    if isinstance(plan, JobConfig):
        plan = _as_plan(plan, not plan.draft.is_none)
    link = job_startup().link
    job = _load_job(link, plan, [], before_load)
    if link.rank != 0:
        _serve_as_worker(link, job)
        return
    cfg = job.cfg
    service.attach(cfg, job.loaded)
    try:
        if cfg.parallel > 1:
            from .parallel import serve_parallel

            serve_parallel(link, cfg, job.loaded, job.trace, service, job.offsets)
            return
        service.idle_check = lambda: link.liveness is not None and link.liveness.check()
        serve_requests(link, cfg, job.loaded, job.trace, service.requests(), job.offsets, service.callbacks())
    except BaseException as exc:
        service.fail(f"the job failed and the server is stopping: {describe(exc)}")
        raise


def run_head_loop(plan: JobPlan | JobConfig, head_main: Callable[[Head], None], needs_draft: bool | None = None) -> bool:
    """Run on every rank of COMM_WORLD: load once, then on the head call head_main(head), which
    runs requests one at a time (`Head.run`, `Head.reset`, `Head.kv_used_cells`) for as long as it
    likes, on the calling thread (a terminal chat, a benchmark); the other ranks serve the pipeline
    meanwhile. When head_main returns the other ranks are shut down; if it raises, they are
    aborted. True on the head. needs_draft: for a bare JobConfig, whether the job runs its draft.
    """
    if isinstance(plan, JobConfig):
        plan = _as_plan(plan, bool(needs_draft))
    link = job_startup().link
    job = _load_job(link, plan, [])
    if link.rank != 0:
        _serve_as_worker(link, job)
        return False
    with Head(link, job.cfg, job.loaded, job.trace, job.offsets) as head:
        head_main(head)
    return True


@dataclass(frozen=True)
class LoadedJob:
    """A job on this rank once every rank has loaded: the configuration it runs with (the head's,
    with this rank's own paths to its weights), its trace recorder and loaded models, and every
    rank's clock offset (on the head; empty elsewhere). The link it runs over is the process's
    (transport/startup.job_startup), not the job's."""

    cfg: JobConfig
    trace: TraceRecorder
    loaded: Loaded
    offsets: list[float]


def _serve_as_worker(link: Link, job: LoadedJob) -> None:
    """A rank other than the head: serve its stage or draft until the head ends the job.
    Workers probe the clocks inside their fault protocol (serve_worker's `before`)."""
    serve_worker(link, job.loaded, job.cfg.debug, job.trace, before=lambda: clock_offsets(link))


@dataclass(frozen=True)
class _BarePlan(JobPlan):
    """A caller's bare configuration (tests, bench's runner: the configuration already decided) as a
    plan without a layout: the head lays it out once its ranks have checked in (_plan_and_load)."""

    def on_hosts(self, default_threads: int, world_size: int | None = None) -> Topology:
        return layout_of(self.cfg, world_size, default_threads, self.drafts)


def _as_plan(cfg: JobConfig, drafts: bool) -> JobPlan:
    return _BarePlan(cfg, "", 0, False, drafts, None)


def _load_job(link: Link, plan: JobPlan, requests: list[Request],
              before_load: Callable[[], None] | None = None) -> LoadedJob:
    """Start up, take the plan and load on this rank; before_load runs on the head only (see run_service)."""
    trace = TraceRecorder(link.rank)
    cfg, loaded, threads = _plan_and_load(link, plan, requests, before_load if link.rank == 0 else None)
    start_liveness(link, cfg.rank_timeout_s, loaded, job_startup().hosts, threads)
    return LoadedJob(cfg, trace, loaded, head_clock_offsets(link) if link.rank == 0 else [])


def head_clock_offsets(link: Link) -> list[float]:
    """The head's side of the clock probes, inside the fault protocol: a rank lost or hung there
    ends the job like one lost later (the other ranks are told to stop)."""
    try:
        return clock_offsets(link)
    except BaseException:
        if link.size > 1:
            abort_job(link)
        raise


def start_liveness(link: Link, rank_timeout_s: float, loaded: Loaded, hosts: list[str], threads: list[int]) -> None:
    """Once every rank has loaded: name the ranks for errors, say whether this rank has its cores
    to itself (waits may then stay awake when PIPEINFER_WAIT_SPIN=tail asks) and whether a CPU
    quota below one CPU holds it (its waits then wake up less often), and with a
    --rank-timeout start the heartbeats and deadlines (transport/liveness.py).

    hosts, threads: every rank's host name and busy threads (start-up's check-ins)."""
    link.name_ranks(rank_names(loaded.topo, hosts))
    here = sum(n for host, n in zip(hosts, threads) if host == hosts[link.rank])
    link.set_alone_on_cores(alone_on_cores(here, threads[link.rank]))
    link.set_cpu_quota(cpu_share().quota_cpus)
    if rank_timeout_s > 0 and link.size > 1:
        engine = loaded.engine
        Liveness(link, rank_timeout_s, engine.eval_progress if engine is not None else (lambda: 0)).start()


def busy_threads(loaded: Loaded) -> int:
    """The threads this rank computes with: its engine's, plus a draft model's beside them on the head."""
    n = loaded.me.threads
    if loaded.me.role == "head" and loaded.drafter is not None and loaded.drafter.has_prompt_pass:
        n += loaded.me.threads  # the draft model runs in a thread of its own, at the rank's thread count
    return n


def rank_names(topo: Topology, hosts: list[str]) -> list[str]:
    """How errors name each rank: 'rank 1 (stage 2 of 3, host node02)'."""
    names = []
    for plan_, host in zip(topo.ranks, hosts):
        if plan_.role == "draft":
            role = "the draft rank"
        elif plan_.rank == 0:
            role = f"the head, stage 1 of {topo.n_stages}"
        else:
            role = f"stage {plan_.rank + 1} of {topo.n_stages}"
        names.append(f"rank {plan_.rank} ({role}, host {host})")
    return names


def _plan_and_load(link: Link, plan: JobPlan, requests: list[Request],
                   before_load: Callable[[], None] | None = None) -> tuple[JobConfig, Loaded, list[int]]:
    """Carry out the plan and load on every rank: (the configuration this rank runs with, its models,
    every rank's busy threads). A failure on any rank is reported once, by the head, naming the rank
    and its host (transport/startup.py)."""
    cfg, needs_draft = plan.cfg, plan.drafts
    startup = job_startup()
    # Every rank checks in before planning, whatever fails later, so that the head learns the
    # hosts (ranks per host for the thread counts), the model files each rank has, and a rank
    # that failed earlier is reported.
    if not startup.started:
        files = local_files(cfg)
        startup.check_in("start", files, deadline_s=start_timeout_s())
    loaded, busy, err, code = None, 0, None, 1
    try:
        if before_load is not None:
            before_load()
        t0 = time.monotonic()
        hosts = startup.hosts
        # The head's layout: the plan's, with the threads of its host (the ranks start-up counted on it).
        head_plan = plan.on_hosts(default_threads(hosts.count(hosts[0])), link.size) if link.rank == 0 else None
        topo, cfg, source = share_plan_and_weights(link, startup, cfg, head_plan, needs_draft, _say)
        loaded = load_rank(cfg, topo, link.rank, requests, needs_draft, hosts)
        loaded.weights = _weights_report(source, time.monotonic() - t0, loaded)
        busy = busy_threads(loaded)
    except Exception as exc:  # noqa: BLE001 - forwarded to the head and reported there
        err, code = describe(exc, traceback_too=cfg.debug), getattr(exc, "exit_code", 1)
    threads = startup.check_in("loaded", busy, err, code)
    return cfg, loaded, threads


def _say(text: str) -> None:
    print(f"pipeinfer: {text}", file=sys.stderr, flush=True)


def _weights_report(source: WeightsSource | None, load_s: float, loaded: Loaded) -> LoadedWeights | None:
    """This rank's "weights" report: where they came from, bytes received, time to get and load
    them, and its memory: the peak while loading and what stays resident once loaded."""
    from ..decode.metrics import process_stats
    from ..process_memory import peak_rss_mib

    if source is None:
        return None
    # This rank's share: its layers' weights (a stage), or the draft file (a draft rank).
    if loaded.engine is not None:
        weight_bytes = loaded.engine.weight_bytes
    else:
        weight_bytes = Path(source.path).stat().st_size if source.path else None
    return LoadedWeights(source, round(load_s, 3), round(peak_rss_mib(), 1), process_stats().rss_mib, weight_bytes)
