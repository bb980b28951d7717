"""`pipeinfer serve` as typed by a user (not inside an MPI job): the front (server/front.py) with the
HTTP server, started before anything slow so that /health answers "loading" at once, and the job
it supervises: its command line, its hosts, and how it is planned again over the hosts left."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable

from ..runtime.service import Service
from ..server.front import Front, JobShape
from ..transport.host_probe import HOSTFILE_ENV, answering, host_name, hostfile_hosts, ranks_on
from .console import err
from .serve_options import _log_request, announce_split, check_parallel, default_split, print_banner, stopped_line
from .job_setup import begin_job
from .wording import plural


def say(line: str) -> None:
    err.print(line if line.startswith("Error: ") else f"pipeinfer serve: {line}", markup=False, highlight=False)


def job_shape(ranks: int, argv: list[str]) -> JobShape:
    """The job as the user asked for it: every rank runs this same command (sys.argv[1:])."""
    return JobShape(ranks=ranks, argv=list(argv), hostfile_hosts=hostfile_hosts())


def replan(shape: JobShape, lost_hosts: list[str]) -> JobShape:
    """The job over the hosts that still answer: the lost hosts' ranks dropped, their layers
    split again (--layer-split auto stays auto, on the profile; a split of fixed fractions goes
    back to the default, balanced by bytes). The job's own load checks whether the model still
    fits in the memory left (its error then ends the server)."""
    if not lost_hosts or not shape.hostfile_hosts:
        return shape
    left = [e for e in shape.hostfile_hosts if e not in lost_hosts]
    if not left:
        raise RuntimeError("no host of the hostfile answers")
    placed = ranks_on(shape.hostfile_hosts, shape.ranks)
    lost_names = {host_name(e) for e in lost_hosts}
    ranks = max(1, sum(1 for h in placed if h not in lost_names))
    with tempfile.NamedTemporaryFile("w", prefix="pipeinfer-serve-", suffix=".hosts", delete=False) as f:
        f.write("\n".join(left) + "\n")
    return JobShape(ranks=ranks, argv=_with_ranks(shape.argv, ranks), hostfile_hosts=left,
                    env={**shape.env, HOSTFILE_ENV: f.name})


def _with_ranks(argv: list[str], ranks: int) -> list[str]:
    """argv with --ranks N and without a --layer-split of fixed fractions (auto stays)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if name in ("--ranks", "-r"):
            i += 1 if eq else 2
            continue
        if name == "--layer-split":
            split = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if split.startswith("auto"):
                out += [a] if eq else argv[i:i + 2]
            i += 1 if eq else 2
            continue
        out.append(a)
        i += 1
    return out + ["--ranks", str(ranks)]


def run_front(service: Service, ranks: int, max_restarts: int, on_ready: Callable, tokenizer_for: Callable,
              on_front: Callable[[Front], None]) -> tuple[int, str | None]:
    """Serve until stopped: the exit status, and the name of the signal that stopped the server."""
    shape = job_shape(ranks, sys.argv[1:])
    front = Front(service, shape, say, max_restarts=max_restarts, replan=replan, on_ready=on_ready,
                  probe_hosts=answering, tokenizer_for=tokenizer_for)
    on_front(front)
    try:
        code = front.run()
    finally:
        planned = front.shape.env.get(HOSTFILE_ENV)  # a hostfile replan() wrote
        if planned and planned != os.environ.get(HOSTFILE_ENV):
            os.unlink(planned)
    return code or front.exit_code, front.stop_signal


def serve_from_front(model, model_opt, mode, job, host: str, port: int, queue: int, parallel: int,
                      load_policy: str, api_key: str | None, prefix_reuse: bool, max_restarts: int) -> int:
    """The command a user typed: the HTTP server here, bound before anything slow (/health answers
    "loading" while models are pulled and a profile calibrated), and the job under a front that
    starts it again when a rank, host or link is lost (cli/serve_front.py, server/front.py)."""
    from ..runtime.service import Service
    from ..runtime.tokenizer import Tokenizer
    from ..server.app import ServerSettings, build_app
    from ..server.http_thread import HttpThread, bind

    sock = bind(host, port)
    service = Service(max_queue=queue, parallel=parallel)
    front: list = []  # the Front, once the job is planned (run_front)
    settings = ServerSettings(model=model or model_opt or "", api_key=api_key, on_finished=_log_request,
                              recovery=lambda: front[0].stats if front else None,
                              slots=lambda: front[0].requests.slot_rows() if front else [])
    http = HttpThread(build_app(service, settings), sock)
    http.start()
    try:
        split_rule = default_split(job, parallel)
        start = begin_job(model, model_opt, mode, job, parallel=parallel, drafts=True,
                          settings={"reuse_prefix": prefix_reuse, "parallel": parallel, "load_policy": load_policy})
        prep = start.prep  # its plan was made from the GGUF header: a split that cannot work failed here
        check_parallel(prep.cfg)
        announce_split(split_rule, prep.plan)
        service.mode, settings.model, settings.draft = prep.mode, prep.cfg.model_label, prep.cfg.draft_label
        every = " (every interface)" if host in ("0.0.0.0", "::", "") else ""
        say(f"listening on {_reachable(host, port)}{every}; loading {prep.cfg.model_label}"
            + (f" (draft {prep.cfg.draft_label})" if prep.cfg.draft_label else "") + " …")

        def on_ready(info, again: bool) -> None:
            if again:
                say(f"serving again: {plural(len(info.ranks), 'rank')}: {'; '.join(info.ranks)}")
            else:
                print_banner(info.cfg, info.ranks, info.default_mode, service.max_queue, _reachable(host, port), prep.auto)

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
    return f"http://{shown}:{port}"
