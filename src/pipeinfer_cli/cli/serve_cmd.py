"""`pipeinfer serve`: load the models once and answer OpenAI-compatible HTTP requests."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated

import typer

from ..decode.parallel_policy import LOAD_POLICIES
from ..decode.result import GenerationResult
from ..errors import OptionValueError
from .console import err
from .generate_cmd import summary_line
from .job_options import JobOptions, job_options
from .job_setup import begin_job, run_here_or_relaunch
from .options import ModelOption, ModeOption, OptionalModelArg
from .wording import epilog, plural

if TYPE_CHECKING:
    from ..runtime.job_config import JobConfig

API_KEY_ENV = "PIPEINFER_API_KEY"
FAIL_GRACE_S = 1.0  # after a rank failed, keep answering 503 this long before the server exits

EPILOG = epilog("""Examples:

  pipeinfer serve smollm2-135m-instruct --ranks 2 --draft lookup

  pipeinfer serve qwen-coder --ranks 2 --port 8081 --queue 4 \\
      --api-key "$(cat key.txt)"

  pipeinfer serve qwen2.5-coder-1.5b-instruct --ranks 2 \\
      --parallel 2 --ctx 8192

  curl -N http://127.0.0.1:8080/v1/chat/completions \\
      -H 'Content-Type: application/json' \\
      -d '{"messages": [{"role": "user", "content": "Hi"}], "stream": true}'

The API: POST /v1/chat/completions, POST /v1/completions (OpenAI format, streaming with "stream":
true), GET /v1/models, GET /health ({"status": "loading"} with 503 until ready, then {"status":
"ok"}), GET /metrics (Prometheus). A request's "mode" field chooses its mode; the server's --mode
applies otherwise, and "speculative" or "pipeinfer" need a server started with a draft (--draft or
a pair name). -n, --temp, --top-k, --top-p, --min-p and --seed are the defaults of requests that do
not set them. Responses name the loaded model, whatever the request's "model" says.

One request is generated at a time, or up to --parallel N at once: each then has its own KV slot
(--ctx / N cells, in whole 256-cell blocks, and its own prefix reuse), and their runs follow each
other through the stages, so while one request's run is on stage 2 another's is on stage 1. Every
request gets exactly the tokens it would get alone. --load-policy says when a request may
speculate beside others; GET /slots shows what each slot does. On several ranks without
--layer-split, --parallel N balances the layers by measured time for N requests at once
(--layer-split auto on --profile, else on a quick calibration cached per machine, model and job
shape, made at the first start); `pipeinfer plan MODEL --parallel N` predicts it. Up to --queue more requests wait in
order, and beyond that the server answers 503 with Retry-After. Ctrl-C, SIGTERM or SIGHUP stops every rank: requests in progress end
with an error, the server prints `pipeinfer serve: stopped by SIGTERM` (or SIGINT, SIGHUP) and exits
with status 0.
""")


@job_options
def serve(
    model: OptionalModelArg = None,
    model_opt: ModelOption = None,
    mode: ModeOption = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (0.0.0.0: every interface; "
                                      "then set --api-key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="TCP port to listen on.")] = 8080,
    queue: Annotated[int, typer.Option("--queue", min=0, max=10000, help="Requests that may wait behind the ones "
                                       "being generated; more get 503 with Retry-After.")] = 8,
    parallel: Annotated[int, typer.Option("--parallel", "-np", min=1, max=32,
                                          help="Requests generated at once (llama-server's -np), each in its own "
                                               "KV slot of --ctx / N cells; their runs share the stages.")] = 1,
    load_policy: Annotated[str, typer.Option("--load-policy", metavar="yield|round-robin|no-spec",
                                             help="With --parallel: when a request may speculate beside others. "
                                                  "yield: only on stages no other request's next token needs; "
                                                  "round-robin: as if alone; no-spec: never while two or more "
                                                  "run.")] = "yield",
    api_key: Annotated[str | None, typer.Option("--api-key", envvar=API_KEY_ENV, show_default=False,
                                                help=f"Require `Authorization: Bearer KEY` on /v1/*, /metrics and /slots "
                                                     f"(or set {API_KEY_ENV}).")] = None,
    max_restarts: Annotated[int, typer.Option("--max-restarts", min=0, max=1000,
                                              help="Times the job may be started again in 10 minutes after a rank, "
                                                   "host or link was lost (requests in flight resume with the same "
                                                   "text); past that the server exits 1.")] = 3,
    prefix_reuse: Annotated[bool, typer.Option("--prefix-reuse/--no-prefix-reuse",
                                               help="Keep the KV cells a request shares with the previous one "
                                                    "(whole 256-token prompt chunks, so answers are unchanged); "
                                                    "timings.cache_n says how many were reused.")] = True,
    job: JobOptions = None,
) -> None:
    """Serve the OpenAI HTTP API from the models loaded once, with the layers split across MPI ranks.

    Rank 0 answers HTTP; every answer is generated in the request's mode (lossless speculation),
    and the response's `timings` say how the speculation went.
    """
    from ..transport.launch import relaunch

    def check_api_key(_inside: bool) -> None:
        if api_key is not None and not api_key.strip():
            raise OptionValueError(f"--api-key (or {API_KEY_ENV}) is empty; give a key or leave it unset")
        if load_policy not in LOAD_POLICIES:
            raise OptionValueError(f"--load-policy {load_policy!r} is not one of {', '.join(LOAD_POLICIES)}")
        if load_policy != "yield" and parallel == 1:
            raise OptionValueError(f"--load-policy {load_policy} applies to parallel requests; give --parallel N "
                                   "(N > 1) too")

    from ..transport.launch import under_mpi_launcher

    if not under_mpi_launcher():
        check_api_key(False)
        raise typer.Exit(_serve_from_front(model, model_opt, mode, job, host, port, queue, parallel, load_policy,
                                           api_key, prefix_reuse, max_restarts))
    split_rule = default_split(job, parallel)
    start = begin_job(model, model_opt, mode, job, check_api_key)
    prep = start.prep
    prep.cfg = replace(prep.cfg, reuse_prefix=prefix_reuse, parallel=parallel, load_policy=load_policy)
    check_parallel(prep.cfg)
    announce_split(split_rule, prep)
    if not start.inside:
        from ..server.http_thread import bind

        bind(host, port).close()  # a port in use is reported now, not after the launch
    # The server loads the draft whenever it has one: each request may choose its mode.
    run_here_or_relaunch(prep, start.inside, prep.has_draft,
                         lambda: relaunch(prep.ranks, sys.argv[1:], clean_stop=stopped_line,
                                          rank_timeout_s=prep.cfg.rank_timeout_s))
    _serve_on_this_rank(prep.cfg, prep.mode, host, port, queue, api_key, prep.auto, prep.ranks)


def _serve_from_front(model, model_opt, mode, job, host: str, port: int, queue: int, parallel: int,
                      load_policy: str, api_key: str | None, prefix_reuse: bool, max_restarts: int) -> int:
    """The command a user typed: the HTTP server here, bound before anything slow (/health answers
    "loading" while models are pulled and a profile calibrated), and the job under a front that
    starts it again when a rank, host or link is lost (cli/serve_front.py, server/front.py)."""
    from ..runtime.service import Service
    from ..runtime.tokenizer import Tokenizer
    from ..server.app import ServerSettings, build_app
    from ..server.http_thread import HttpThread, bind
    from .serve_front import run_front, say

    sock = bind(host, port)
    service = Service(max_queue=queue, parallel=parallel)
    front: list = []  # the Front, once the job is planned (run_front)
    settings = ServerSettings(model=model or model_opt or "", api_key=api_key, on_finished=_log_request,
                              recovery=lambda: front[0].stats if front else None,
                              slots=lambda: front[0].slot_rows() if front else [])
    http = HttpThread(build_app(service, settings), sock)
    http.start()
    try:
        split_rule = default_split(job, parallel)
        start = begin_job(model, model_opt, mode, job)
        prep = start.prep
        prep.cfg = replace(prep.cfg, reuse_prefix=prefix_reuse, parallel=parallel, load_policy=load_policy)
        check_parallel(prep.cfg)
        announce_split(split_rule, prep)
        if prep.ranks > 1:
            from .job_setup import check_plan

            check_plan(prep.cfg, prep.ranks, prep.has_draft)
        service.mode, settings.model, settings.draft = prep.mode, prep.cfg.model_label, prep.cfg.draft_label
        say(f"listening on {_reachable(host, port)}; loading {prep.cfg.model_label}"
            + (f" (draft {prep.cfg.draft_label})" if prep.cfg.draft_label else "") + " …")

        def on_ready(info, again: bool) -> None:
            if again:
                say(f"serving again: {plural(len(info.ranks), 'rank')}: {'; '.join(info.ranks)}")
            else:
                _banner_lines(info, service, host, port, prep.auto)

        code, stopped_by = run_front(service, prep.ranks, max_restarts, on_ready, lambda cfg: Tokenizer(cfg.model_path),
                                     front.append)
    except BaseException:
        service.fail("the server is stopping")
        raise
    finally:
        http.stop()
    if code == 0:
        err.print(stopped_line(stopped_by), markup=False, highlight=False)
    return code


def _reachable(host: str, port: int) -> str:
    """The address a client can use: the host given, or this machine's name for every interface."""
    import socket

    shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    return f"http://{shown}:{port}" + (" (every interface)" if shown != host else "")


def _banner_lines(info, service, host: str, port: int, auto=None) -> None:
    """Printed once the job has loaded, in the manner of llama-server."""
    cfg = info.cfg
    chosen = "" if auto is None else f" (-M {auto.summary(None)})"
    lines = [f"model {cfg.model_label}, draft {cfg.draft_label or 'none'}, default mode {info.default_mode}{chosen}, "
             f"context {cfg.n_ctx} cells, queue {service.max_queue}" +
             (f", {cfg.parallel} slots of {cfg.slot_ctx} cells ({cfg.load_policy})" if cfg.parallel > 1 else ""),
             f"{plural(len(info.ranks), 'rank')}: {'; '.join(info.ranks)}",
             f"ready: {_reachable(host, port)}/v1 (chat/completions, completions, models), /health, /metrics, /slots"]
    for line in lines:
        err.print(f"pipeinfer serve: {line}", markup=False, highlight=False)


def default_split(job, parallel: int, environ=os.environ) -> str | None:
    """The split of `serve --parallel N` (N > 1) on several ranks when --layer-split is not given
    (docs/server.md, "The default split"): the layers balanced by measured time for N requests at
    once (`auto`), since parallel requests go as fast as the slowest stage and the byte-balanced
    split leaves the stage with the LM head short of work. Its profile is --profile, else the quick
    calibration cached for this job's shape, else one made now (as for -M auto). Under a launcher
    of the user's own (mpiexec ... pipeinfer serve, not relaunched by pipeinfer) a calibration
    cannot start inside the job, so there the default is auto only with --profile, else by bytes.

    Sets job.layer_split to "auto" when the rule applies; returns "auto", "bytes" (the rule applies
    but no profile can be had) or None (not a parallel job on several ranks, or a split given)."""
    from ..transport.launch import RELAUNCHED, under_mpi_launcher

    if parallel <= 1 or job.layer_split is not None or (job.ranks or 1) <= 1:
        return None
    if under_mpi_launcher() and not environ.get(RELAUNCHED) and job.profile is None:
        return "bytes"
    job.layer_split = "auto"
    _say(f"--parallel {parallel} on {job.ranks} ranks without --layer-split: the layers go to the stages by "
         f"measured time for {parallel} requests at once (--layer-split auto), not by bytes; give --layer-split "
         "to choose")
    return "auto"


def announce_split(rule: str | None, prep) -> None:
    """Which split default_split's rule gave, beside the byte-balanced one (stderr, once per job)."""
    from dataclasses import replace

    from ..runtime.topology import format_layer_ranges, plan_config

    if rule is None or not _speaks():
        return
    cfg = prep.cfg
    if rule == "bytes":
        _say(f"--parallel {cfg.parallel} under your MPI launcher without --profile: the layers are split by bytes "
             "(no quick calibration inside a job); pass --profile FILE (`pipeinfer calibrate`) to balance them by "
             "measured time for parallel requests")
        return
    layers = lambda c: format_layer_ranges([r.layers for r in plan_config(c, prep.ranks, prep.ranks, prep.has_draft).ranks])  # noqa: E731
    _say(f"split for {cfg.parallel} requests at once: layers {layers(cfg)} (profile {cfg.profile}); by bytes they "
         f"would be {layers(replace(cfg, layer_split=None))}")


def _speaks() -> bool:
    """Whether this process says the job's start-up lines: the launching command (or rank 0 under a
    launcher of the user's own), not every rank of the job."""
    from ..transport.launch import RELAUNCHED, under_mpi_launcher
    from ..transport.start_waits import launcher_rank

    return not under_mpi_launcher() or (not os.environ.get(RELAUNCHED) and launcher_rank() == 0)


def _say(text: str) -> None:
    if _speaks():
        err.print(f"pipeinfer serve: {text}", markup=False, highlight=False)


def check_parallel(cfg: JobConfig) -> None:
    """--parallel N needs N slots of at least 256 cells and N shares of the engine's sequence ids."""
    from ..decode.slot_geometry import MAX_SEQUENCES, SLOT_CELL_BLOCK

    n, geometry = cfg.parallel, cfg.geometry
    if n == 1:
        return
    if geometry.cells_per_slot < SLOT_CELL_BLOCK:
        raise OptionValueError(f"--parallel {n} splits --ctx {cfg.n_ctx} into slots of fewer than 256 cells; "
                               f"raise --ctx to at least {256 * n} or lower --parallel")
    per = geometry.seqs_per_slot
    if not geometry.fits:
        most = geometry.max_inflight_fitting(cfg.decode.max_branches)
        raise OptionValueError(f"--parallel {n} needs {per * n} KV sequences ({per} per request: --max-inflight "
                               f"{cfg.decode.max_inflight} x --max-branches {cfg.decode.max_branches} + 2), more "
                               f"than {MAX_SEQUENCES}; lower --parallel to {MAX_SEQUENCES // per}, or --max-inflight "
                               f"to {most}")


def _serve_on_this_rank(cfg: JobConfig, mode: str, host: str, port: int, queue: int, api_key: str | None, auto=None,
                        n_ranks: int = 1) -> None:
    """Rank 0: the HTTP server (its own thread) and the pipeline (this thread). Other ranks: the pipeline."""
    from mpi4py import MPI

    from ..runtime.job import run_service
    from ..runtime.service import Service

    if MPI.COMM_WORLD.Get_rank() != 0:
        run_service(cfg, None)
        return
    from ..transport.front_channel import connect_to_front

    channel = connect_to_front()
    if channel is not None:  # started by the front of `pipeinfer serve`: it answers HTTP
        _serve_engine(cfg, mode, channel, auto, n_ranks)
        return
    service = Service(max_queue=queue, mode=mode, on_ready=lambda s: _banner(s, host, port, auto), parallel=cfg.parallel)
    if auto is not None:
        _replan_as_it_serves(service, cfg, auto, n_ranks)
    http = _HttpStarter(service, cfg, host, port, api_key)
    stopped_by = _stop_on_signals(service)
    try:
        run_service(cfg, service, before_load=http.start)
    except BaseException:
        if service.status == "failed":
            time.sleep(FAIL_GRACE_S)  # clients in flight get their 503 before the server goes
        raise
    finally:
        http.stop()
    err.print(stopped_line(stopped_by[0] if stopped_by else None), markup=False, highlight=False)


def _serve_engine(cfg: JobConfig, mode: str, channel, auto, n_ranks: int) -> None:
    """The head of a job a front started (runtime/engine.py). A failure was sent to the front, which
    says what happened and starts the job again: this rank leaves without a line of its own."""
    from ..runtime.engine import serve_engine
    from ..runtime.service import Service

    service = Service(max_queue=100_000, mode=mode, parallel=cfg.parallel)
    if auto is not None:
        _replan_as_it_serves(service, cfg, auto, n_ranks)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the front decides what a hang-up means
    try:
        serve_engine(cfg, service, channel)
    except Exception:  # noqa: BLE001 - reported by the front
        raise typer.Exit(1) from None


def _replan_as_it_serves(service, cfg: JobConfig, auto, n_ranks: int) -> None:
    """-M auto: requests that bring no settings of their own run on auto's, planned again when the
    acceptance measured over the requests served so far leaves the one planned on (as chat does
    between turns: cli/auto_mode.Replanner); the line that says so goes to stderr."""
    from .auto_mode import Replanner

    plan = Replanner(cfg, auto, n_ranks, lambda line: err.print(line, markup=False, highlight=False))
    service.default_decode = lambda: plan.decode

    def count(ticket, result: GenerationResult) -> None:
        ran_on_auto = (ticket.request.mode or service.default_mode()) == auto.mode and not ticket.request.speculative
        if ran_on_auto and result.acceptance is not None and result.acceptance.drafted:
            plan.after_in_background(result.acceptance.drafted, result.acceptance.accepted)

    service.add_observer(count)


def stopped_line(signal_name: str | None) -> str:
    """How a server that was told to stop ends, on one rank or many: a line on stderr, exit status 0
    (a stop signal is how a server is meant to end, not an error)."""
    return "pipeinfer serve: stopped" + (f" by {signal_name}" if signal_name else "")


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
    from ..runtime.topology import format_layer_ranges

    cfg, topo = service.cfg, service.loaded.topo
    ranks = "; ".join(f"{r.rank} {r.role} ({format_layer_ranges([r.layers])}, {plural(r.threads, 'thread')})" for r in topo.ranks)
    chosen = "" if auto is None else f" (-M {auto.summary(None)})"
    lines = [f"model {cfg.model_label}, draft {cfg.draft_label or 'none'}, default mode {service.default_mode()}{chosen}, "
             f"context {cfg.n_ctx} cells, queue {service.max_queue}" +
             (f", {cfg.parallel} slots of {cfg.slot_ctx} cells ({cfg.load_policy})" if cfg.parallel > 1 else ""),
             f"{plural(len(topo.ranks), 'rank')}: {ranks}",
             f"ready: http://{host}:{port}/v1 (chat/completions, completions, models), /health, /metrics, /slots"]
    for line in lines:
        err.print(f"pipeinfer serve: {line}", markup=False, highlight=False)


def _log_request(endpoint: str, result: GenerationResult) -> None:
    line = summary_line(result).removeprefix("pipeinfer: ")
    err.print(f"pipeinfer serve: {endpoint} #{result.prompt_id}: {result.finish_reason}, {line}",
              markup=False, highlight=False)
