"""`pipeinfer serve` as a rank of an MPI job: the head of a job that the front started
(runtime/engine.py), or, under a launcher of the user's own, rank 0 answering HTTP itself (nothing
outside the job could start it again: a lost rank ends the server, every client told)."""

from __future__ import annotations

import signal
import threading
import time
from typing import TYPE_CHECKING

import typer

from ..decode.result import GenerationResult
from .console import err
from .serve_options import _log_request, print_banner, stopped_line

if TYPE_CHECKING:
    from ..planner.job_config import JobConfig
    from ..planner.job_plan import JobPlan

FAIL_GRACE_S = 1.0  # after a rank failed, keep answering 503 this long before the server exits


def serve_on_this_rank(plan: JobPlan, host: str, port: int, queue: int, api_key: str | None) -> None:
    """Rank 0: the HTTP server (its own thread) and the pipeline (this thread). Other ranks: the pipeline."""
    from mpi4py import MPI

    from ..runtime.job import run_service
    from ..runtime.service import Service

    cfg, mode, auto, n_ranks = plan.cfg, plan.mode, plan.auto, plan.ranks
    if MPI.COMM_WORLD.Get_rank() != 0:
        run_service(plan, None)
        return
    from ..transport.front_channel import connect_to_front

    channel = connect_to_front()
    if channel is not None:  # started by the front of `pipeinfer serve`: it answers HTTP
        _serve_engine(plan, channel)
        return
    service = Service(max_queue=queue, mode=mode, on_ready=lambda s: _banner(s, host, port, auto), parallel=cfg.parallel)
    if auto is not None:
        _replan_as_it_serves(service, cfg, auto, n_ranks)
    http = _HttpStarter(service, cfg, host, port, api_key)
    stopped_by = _stop_on_signals(service)
    try:
        run_service(plan, service, before_load=http.start)
    except BaseException:
        if service.status == "failed":
            time.sleep(FAIL_GRACE_S)  # clients in flight get their 503 before the server goes
        raise
    finally:
        http.stop()
    err.print(stopped_line(stopped_by[0] if stopped_by else None), markup=False, highlight=False)


def _serve_engine(plan: JobPlan, channel) -> None:
    """The head of a job a front started (runtime/engine.py). A failure was sent to the front, which
    says what happened and starts the job again: this rank leaves without a line of its own."""
    from ..runtime.engine import serve_engine
    from ..runtime.service import Service

    service = Service(max_queue=100_000, mode=plan.mode, parallel=plan.cfg.parallel)
    if plan.auto is not None:
        _replan_as_it_serves(service, plan.cfg, plan.auto, plan.ranks)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the front decides what a hang-up means
    try:
        serve_engine(plan, service, channel)
    except Exception:  # noqa: BLE001 - reported by the front
        raise typer.Exit(1) from None


def _replan_as_it_serves(service, cfg: JobConfig, auto, n_ranks: int) -> None:
    """-M auto: requests that bring no settings of their own run on auto's, planned again when the
    acceptance measured over the requests served so far leaves the one planned on (as chat does
    between turns: planner/replan.Replanner); the line that says so goes to stderr."""
    from ..planner.replan import Replanner

    plan = Replanner(cfg, auto, n_ranks, lambda line: err.print(line, markup=False, highlight=False))
    service.default_decode = lambda: plan.decode

    def count(ticket, result: GenerationResult) -> None:
        ran_on_auto = (ticket.request.mode or service.default_mode()) == auto.mode and not ticket.request.speculative
        if ran_on_auto and result.acceptance is not None and result.acceptance.drafted:
            plan.after_in_background(result.acceptance.drafted, result.acceptance.accepted)

    service.add_observer(count)


class _HttpStarter:
    """Binds and starts the HTTP server on the head, before the models load (then /health says loading)."""

    def __init__(self, service, cfg: JobConfig, host: str, port: int, api_key: str | None):
        self.service, self.cfg, self.host, self.port, self.api_key = service, cfg, host, port, api_key
        self.http = None

    def start(self) -> None:
        from ..server.app import ServerSettings, build_app
        from ..server.http_thread import HttpThread, bind

        settings = ServerSettings(model=self.cfg.model_label, draft=self.cfg.draft_label, api_key=self.api_key,
                                  on_finished=_log_request)
        self.http = HttpThread(build_app(self.service, settings), bind(self.host, self.port))
        self.http.start()
        err.print(f"pipeinfer serve: listening on http://{self.host}:{self.port}; loading {self.cfg.model_label}"
                  + (f" (draft {self.cfg.draft_label})" if self.cfg.draft_label else "") + " …",
                  markup=False, highlight=False)

    def stop(self) -> None:
        if self.http is not None:
            self.http.stop()


def _stop_on_signals(service) -> list[str]:
    """Ctrl-C, SIGTERM, SIGHUP: stop the service. The handler runs on this (the pipeline) thread,
    between two bytecodes, so the work is handed to a thread of its own. Returns the list that
    receives the name of the first signal."""
    stopped_by: list[str] = []

    def on_signal(signum, _frame) -> None:
        if not stopped_by:
            stopped_by.append(signal.Signals(signum).name)
        threading.Thread(target=service.stop, args=(f"the server is shutting down ({signal.Signals(signum).name})",),
                         daemon=True).start()

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)
    return stopped_by


def _banner(service, host: str, port: int, auto=None) -> None:
    """Printed once the models are loaded, in the manner of llama-server."""
    from ..runtime.engine import describe_ranks

    print_banner(service.cfg, describe_ranks(service.loaded.topo), service.default_mode(), service.max_queue,
                 f"http://{host}:{port}", auto)
