"""`pipeinfer bench --concurrency`: the same models and job options served by one `pipeinfer serve`
job, loaded with C requests in flight at once for each level C (bench/concurrency.py)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import shlex
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from ..errors import PipeinferError, error_line
from .job_options import JobOptions
from .wording import plural

if TYPE_CHECKING:
    from ..planner.job_config import JobConfig


class RequestsFailedError(PipeinferError):
    """Requests of the benchmark ended with an error instead of a completion."""


class _StopSignal(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def serve_params() -> dict:
    """{parameter name: click parameter} of `pipeinfer serve`, as its parser knows them."""
    from . import serve_cmd

    app = typer.Typer()
    app.command()(serve_cmd.serve)
    return {p.name: p for p in typer.main.get_command(app).params}


def serve_args(model: str, job: JobOptions, *, needs_draft: bool, parallel: int, queue: int,
               load_policy: str | None = None) -> list[str]:
    """The `pipeinfer serve` arguments for bench's model and job options: every shared job option
    that differs from its default, as `--name=value` (the draft only if a mode needs it; --no-pull,
    as bench resolved the models already), plus --queue, --parallel (given only when not 1) and
    --load-policy (when given)."""
    params = serve_params()
    out = [model]
    for f in dataclasses.fields(JobOptions):
        value = getattr(job, f.name)
        if f.name in ("no_pull",) or (f.name == "draft" and not needs_draft) or value is None or value == f.default:
            continue
        name = next(o for o in params[f.name].opts if o.startswith("--"))
        if isinstance(value, bool):
            if value:
                out.append(name)
            continue
        out.append(f"{name}={value}")
    out += ["--no-pull", f"--queue={queue}"]
    if parallel != 1:
        out.append(f"--parallel={parallel}")
    if load_policy is not None:
        out.append(f"--load-policy={load_policy}")
    return out


@contextmanager
def _stop_signals():
    """SIGTERM and SIGHUP end the benchmark as Ctrl-C does (the server is stopped on the way out)."""
    def on_signal(signum, _frame):
        raise _StopSignal(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _versions() -> dict:
    """bench/environment.versions() without starting MPI in this process (no rank lives here)."""
    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from ..bench import environment

    return environment.versions()


class TextMismatchError(PipeinferError):
    """A text at some concurrency differs from the same prompt's text at concurrency 1."""


class _Progress:
    """Progress lines on stderr: the server's start, each level, each request."""

    def __init__(self, console):
        self.console, self.done = console, 0

    def say(self, text: str, **kw) -> None:
        self.console.print(text, markup=False, highlight=False, **kw)

    def level(self, mode: str, level: int, n: int, warm: bool) -> None:
        self.done = 0
        self.say(f"bench: {mode} · {'warmup, one at a time' if warm else f'concurrency {level}'}: {plural(n, 'request')} …")

    def record(self, rec: dict) -> None:
        from ..bench.concurrency import short_record

        self.done += 1
        tag = "warmup" if rec["warmup"] else f"c={rec['concurrency']}"
        self.say(f"bench [{rec['mode']} · {tag}] {self.done}: {short_record(rec)}")

    def level_done(self, mode: str, level: int, records: list[dict], wall: float) -> None:
        tokens = sum(r["completion_tokens"] or 0 for r in records)
        self.say(f"bench: {mode} · concurrency {level}: {plural(tokens, 'token')} in {wall:.2f} s"
                 + (f", {tokens / wall:.2f} tok/s" if wall > 0 else ""))


def _serve_and_load(args: list[str], progress: _Progress, run) -> tuple:
    """Start `pipeinfer serve ARGS`, wait until it is ready, run(base_url, check_alive) → the load,
    stop the server (also on an error, Ctrl-C, SIGTERM or SIGHUP). Returns (load, server facts)."""
    import asyncio

    from ..bench.server_job import ServerFailed, ServerJob

    server = None
    keep_log = False  # the log of a server that failed is named in the error; otherwise it goes
    try:
        with _stop_signals():
            server = ServerJob.start(args)
            progress.say(f"bench: starting pipeinfer {shlex.join(server.argv)}")
            ready_s = server.wait_ready(lambda status, t: progress.say(f"bench: server {status} ({t:.0f} s) …"))
            progress.say(f"bench: server ready after {ready_s:.1f} s at {server.base_url}")
            banner = [line.removeprefix("pipeinfer serve: ") for line in server.log.read_text(errors="replace").splitlines()
                      if line.startswith("pipeinfer serve: ")]
            load = asyncio.run(run(server.base_url + "/v1", server.check_alive))
            rc = server.stop()
    except ServerFailed:
        keep_log = True
        raise
    except _StopSignal as s:
        if server is not None:
            server.stop()
        progress.say(error_line(f"stopped by {signal.Signals(s.signum).name}"))
        raise typer.Exit(128 + s.signum) from None
    finally:
        if server is not None:
            server.stop()
            if not keep_log:
                server.remove_log()
    return load, {"command": "pipeinfer " + shlex.join(server.argv), "ready_s": ready_s, "banner": banner,
                  "exit_status": rc}


def run_concurrency(*, serve_model: str, job: JobOptions, cfg: JobConfig, target, draft_ref, needs_draft: bool,
                    mode_list: list[str], levels: list[int], parallel: int, load_policy: str | None, prompt_set,
                    prompts_file: Path | None,
                    repeat: int, warmup: int, ranks: int, json_out: Path | None, allow_mismatch: bool,
                    consoles) -> None:
    """Start the server, run the load, stop the server; then the table, the JSON and the checks."""
    from ..bench import concurrency as cc

    out_console, err_console = consoles
    progress = _Progress(err_console)
    sampling = cc.Sampling(n_predict=job.n_predict, temperature=job.temp, seed=job.seed, top_k=job.top_k,
                           top_p=job.top_p, min_p=job.min_p)

    def run(base_url: str, check_alive):
        return cc.run_load(base_url, prompt_set, mode_list, levels, repeat, warmup, sampling, check_server=check_alive,
                           on_level=progress.level, on_record=progress.record, on_level_done=progress.level_done)

    args = serve_args(serve_model, job, needs_draft=needs_draft, parallel=parallel, queue=max(levels),
                      load_policy=load_policy)
    load, server = _serve_and_load(args, progress, run)
    records = load.records
    mismatches = cc.check_identical(records)
    rows = cc.summarize(records, mode_list, levels, load.walls, load.peaks)
    header = _header(cfg, target, draft_ref, needs_draft, mode_list, levels, (parallel, load_policy), prompt_set,
                     prompts_file, repeat, warmup, ranks, job, server)
    out_console.print(cc_table(rows, header))
    if json_out:
        from ..bench.export import write_json

        write_json(json_out, cc.document(header, rows, mismatches, records))
        progress.say(f"wrote {json_out}")
    _check(records, mismatches, progress, allow_mismatch, json_out is not None)


def _check(records: list[dict], mismatches: list[dict], progress: _Progress, allow_mismatch: bool, wrote: bool) -> None:
    """Failed requests and texts that differ: on stderr, then the error the command exits with."""
    from ..bench.concurrency import describe_mismatch

    failed = [r for r in records if r["error"] is not None]
    for r in failed:
        progress.say(f"REQUEST FAILED: {r['mode']} at concurrency {r['concurrency']}, prompt {r['prompt_id']!r}: "
                     f"{r['error']}", style="bold red")
    for m in mismatches:
        progress.say(f"TEXT DIFFERS: {describe_mismatch(m)}", style="bold red")
    if failed:
        raise RequestsFailedError(f"{plural(len(failed), 'request')} failed; the table and JSON count them (n_errors)")
    if not mismatches:
        return
    prompts = sorted({m["prompt_id"] for m in mismatches})
    if allow_mismatch:
        progress.say(f"Warning: concurrency changed the text of {plural(len(prompts), 'prompt')}; exiting 0 because "
                     "of --allow-mismatch", style="bold red")
        return
    raise TextMismatchError(
        f"the text at some concurrency differs from the text at concurrency 1 on {plural(len(prompts), 'prompt')} "
        f"({', '.join(prompts)}); serving more requests at once must not change them — the results above are "
        "flagged" + (" and the JSON records it (identical_to_level_1: false)" if wrote else ""))


def cc_table(rows: list[dict], header: dict):
    from ..bench.report import concurrency_table

    c = header["config"]
    models = header["models"]
    draft = models["draft"]["name"] if models.get("draft") else None
    title = (f"{models['target']['name']}" + (f" + draft {draft}" if draft else "")
             + f" · pipeinfer serve on {plural(c['ranks'], 'rank')}, --parallel {c['parallel']}"
             + f" · -n {c['n_predict']} · {plural(c['prompts']['count'], 'prompt')} × {plural(c['repeat'], 'repeat')}"
             + " per level")
    return concurrency_table(rows, title)


def _header(cfg: JobConfig, target, draft_ref, needs_draft, mode_list, levels, serving: tuple, prompt_set, prompts_file, repeat,
            warmup, ranks, job, server: dict) -> dict:
    """serving: the server's (--parallel, --load-policy or None)."""
    parallel, load_policy = serving
    from ..bench import environment
    from ..bench.results import describe_config

    config = describe_config(cfg, mode_list, prompt_set, prompts_file, repeat=repeat, warmup=warmup, ranks=ranks,
                             layer_split=job.layer_split, threads=job.threads)
    config.update({"concurrency": levels, "parallel": parallel, "load_policy": load_policy or "yield"})
    return {
        "created_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "pipeinfer " + shlex.join(sys.argv[1:]),
        "versions": _versions(),
        "models": {"target": environment.model_ref_facts(target),
                   "draft": environment.model_ref_facts(draft_ref, cfg.draft_label) if needs_draft else None},
        "host": environment.host_facts(),
        "config": config,
        "server": server,
    }
