"""`pipeinfer bench`: every decoding mode over a prompt set, in one job, side by side."""

from __future__ import annotations

from dataclasses import replace

from typing import TYPE_CHECKING

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..decode.draft_spec import DraftSpec
from ..decode.modes import needs_draft as mode_needs_draft
from ..errors import PipeinferError, UsageError
from .job_setup import PreparedJob, check_chat_template, check_n_predict, prepare_job, run_here_or_relaunch
from .job_options import JobOptions, job_options
from .options import ModelArg, SaveTraceOption
from .wording import epilog, plural

if TYPE_CHECKING:
    from ..planner.job_config import JobConfig

DEFAULT_MODES = "iterative,speculative,pipeinfer"
NON_TTY_WIDTH = 200
# The relaunched MPI job cannot see the user's terminal; the parent passes what it saw.
_TTY_ENV = {"stdout": "PIPEINFER_STDOUT_TTY", "stderr": "PIPEINFER_STDERR_TTY"}

EPILOG = epilog("""Examples:

  pipeinfer bench qwen-coder --ranks 2 -n 128 --json bench.json \\
      --plot bench.png

  pipeinfer bench smollm2-135m-instruct --draft smollm2-135m-instruct \\
      --modes iterative,speculative --prompts my.jsonl --repeat 3 --warmup 1 \\
      --ranks 2 --csv bench.csv --trace bench.trace.json

Prompt files are JSONL, one object per line: {"id": "x", "prompt": "raw text"} or
{"id": "y", "messages": [{"role": "user", "content": "..."}]}. Without --prompts, a shipped set of
8 coding and prose prompts is used ('default'); --prompts grounded selects the other shipped set,
8 tasks whose answer copies from a 400-550-token prompt (where --draft lookup is right most often):

  pipeinfer bench qwen2.5-coder-1.5b-instruct --draft lookup \\
      --prompts grounded -n 96 --ranks 2

Under load: --concurrency 1,2,4 starts one `pipeinfer serve` job with the same models and job
options on a free localhost port (--parallel P, default the largest level) and, for each mode and
each level C, sends the prompt set as streaming requests with C in flight at once (when one ends,
the next starts). The table shows per level aggregate tok/s, requests/s, TTFT and inter-token
latency p50/p99 and the mean per-request decode tok/s; level 1 is always run, and every text must
equal its text at level 1 (else the command exits 1):

  pipeinfer bench smollm2-135m-instruct --modes iterative \\
      --concurrency 1,2,4 --limit 4 -n 64 --json load.json

--save-trace FILE keeps the prompts' traces for `pipeinfer plan --trace FILE` (the first run of each
prompt records it: its tokens and a draft model's chains, asked of the job's draft after that run).

Modes run interleaved (A, B, C, A, B, C …) on models loaded once. Every mode must produce the same
tokens: a difference is flagged in the table, on stderr and in the JSON (tokens_identical,
token_mismatches), and the command then exits with status 1 after writing its outputs (0 with
--allow-mismatch). Open --trace files in https://ui.perfetto.dev or chrome://tracing.
""")


class TokenMismatchError(PipeinferError):
    """Two modes (or two repeats) generated different tokens for the same prompt."""


def _check_plot_support(plot_out: Path | None) -> None:
    if plot_out is not None:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise UsageError("--plot needs matplotlib; install it with `pip install 'matplotlib>=3.8,<4'`")


def _check_models(prep: PreparedJob, mode_list: list[str], prompt_set) -> bool:
    """Whether a mode needs the draft, once the models are resolved (prepare_job): the prompts checked
    against the target (chat ones need a template) and the modes against the draft."""
    needs_draft = any(mode_needs_draft(m) for m in mode_list)
    chats = [p.id for p in prompt_set if p.messages is not None]
    if chats:
        check_chat_template(prep.cfg.model_path, prep.cfg.model_label,
                            f"the chat prompts of the prompt set ({', '.join(chats)})")
    if needs_draft and prep.cfg.draft.is_none:
        wants = ", ".join(m for m in mode_list if mode_needs_draft(m))
        raise UsageError(f"--modes {wants} need a draft: pass --draft MODEL, --draft lookup, or a pair name such as qwen-coder")
    return needs_draft


def parse_modes(text: str) -> list[str]:
    from ..decode.modes import MODE_NAMES as MODES

    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes:
        raise UsageError(f"--modes is empty; choose from {', '.join(MODES)}")
    for m in modes:
        if m not in MODES:
            raise UsageError(f"unknown mode {m!r} in --modes; choose from {', '.join(MODES)}")
    dupes = sorted({m for m in modes if modes.count(m) > 1})
    if dupes:
        raise UsageError(f"--modes lists {', '.join(dupes)} more than once")
    return modes


@job_options
def bench(
    model: ModelArg,
    modes: Annotated[str, typer.Option("--modes", help="Comma-separated modes to compare, in run order within each round.")] = DEFAULT_MODES,
    prompts: Annotated[str | None, typer.Option("--prompts", help="A shipped prompt set, 'default' or 'grounded' (answers that copy from 400-550-token prompts: edit, fix, convert code, answer from a document), or a JSONL file (id + prompt or messages per line). Default: 'default'.")] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Use only the first N prompts of the file.")] = None,
    repeat: Annotated[int, typer.Option("--repeat", min=1, help="Measured runs of every (prompt, mode).")] = 1,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Rounds of every mode run first and left out of the statistics.")] = 1,
    job: JobOptions = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write every record, the per-mode summary and the header (versions, checksums, host) as JSON.")] = None,
    csv_out: Annotated[Path | None, typer.Option("--csv", help="Write the records flat as CSV (header as '# key: value' comment lines).")] = None,
    trace_out: Annotated[Path | None, typer.Option("--trace", help="Write a Chrome trace-event timeline, one track per rank (Perfetto, chrome://tracing).")] = None,
    plot_out: Annotated[Path | None, typer.Option("--plot", help="Write a PNG: tok/s per mode and per-rank utilisation timelines.")] = None,
    allow_mismatch: Annotated[bool, typer.Option("--allow-mismatch", help="Still flag modes that generated different tokens, but exit 0.")] = False,
    concurrency: Annotated[str | None, typer.Option("--concurrency", metavar="C[,C...]", show_default=False, help="Measure under load: serve the models with one `pipeinfer serve` job and, for each mode and each level, keep C streaming requests in flight at once (e.g. 1,2,4,8; level 1 is always added). Writes --json only.")] = None,
    parallel: Annotated[int | None, typer.Option("--parallel", "-np", min=1, max=32, show_default=False, help="With --concurrency: the server's --parallel (requests it generates at once). Default: the largest level; 1: one at a time, the others wait in its queue.")] = None,
    load_policy: Annotated[str | None, typer.Option("--load-policy", metavar="yield|round-robin|no-spec", show_default=False, help="With --concurrency: the server's --load-policy (when a request may speculate beside others). Default: yield.")] = None,
    save_trace: SaveTraceOption = None,
) -> None:
    """Compare the decoding modes on the same ranks and prompts: speed, latency, acceptance, timelines.

    The table goes to stdout, progress to stderr; --json/--csv/--trace/--plot write files.
    """
    from ..bench.prompts import load_prompts, resolve_prompts
    from ..bench.schedule import build_schedule
    from ..transport.launch import under_mpi_launcher

    # Everything that can be wrong in the input fails here, before a model is pulled or loaded.
    mode_list = parse_modes(modes)
    check_n_predict(job.n_predict)
    prompts_file = resolve_prompts(prompts)
    prompt_set = load_prompts(prompts_file, limit)
    levels = _check_outputs(json_out, csv_out, trace_out, plot_out, concurrency, parallel, load_policy)  # --concurrency
    _check_save_trace(save_trace, job, levels, [json_out, csv_out, trace_out, plot_out])
    # Every job command's set-up (models, ranks, JobConfig), then its one launcher (run_here_or_relaunch).
    inside = under_mpi_launcher()
    prep = prepare_job(model, None, job, inside, place=False, drafts=any(mode_needs_draft(m) for m in mode_list))
    cfg, target, draft_ref, spec, want = prep.cfg, prep.target, prep.draft_ref, prep.cfg.draft, prep.ranks
    needs_draft = _check_models(prep, mode_list, prompt_set)
    if levels is not None:  # under load: one `pipeinfer serve` job (cli/bench_serve.py)
        return _bench_under_load(model, job, cfg, target, draft_ref, needs_draft, mode_list, levels,
                                 (parallel or min(max(levels), 32), load_policy), prompt_set, prompts_file, repeat, warmup, want,
                                 json_out, allow_mismatch)
    run_here_or_relaunch(prep, inside, lambda: _relaunch_job(want))
    if not needs_draft and not (save_trace and spec.uses_model):
        cfg = replace(cfg, draft_path=None, draft=DraftSpec.none())  # iterative only: do not load a draft model
    traced: list | None = [] if save_trace else None
    records = _run(cfg, build_schedule(prompt_set, mode_list, repeat, warmup), traced)
    if records is None:  # a worker rank: the head reports
        return
    _save_trace(save_trace, cfg, traced)

    from ..bench.environment import model_ref_facts
    from ..bench.results import collect, describe_config

    config = describe_config(cfg, mode_list, prompt_set, prompts_file, repeat=repeat, warmup=warmup, ranks=want,
                             layer_split=job.layer_split, threads=job.threads)
    models = {"target": model_ref_facts(target), "draft": model_ref_facts(draft_ref, cfg.draft_label) if needs_draft else None}
    res = collect(records, mode_list, models, config, "pipeinfer " + shlex.join(sys.argv[1:]))
    _report(res, records, mode_list, len(prompt_set) > 1, {"json": json_out, "csv": csv_out, "trace": trace_out,
                                                           "plot": plot_out}, allow_mismatch)


def _check_save_trace(path: Path | None, job, levels, others: list) -> None:
    """--save-trace: greedy, a file of its own (others: --json, --csv, --trace, --plot), and bench's
    own job (not --concurrency's server)."""
    if path is None:
        return
    from ..bench.outputs import check_output_paths
    from ..runtime.job_trace import check_greedy

    if levels is not None:
        raise UsageError("--save-trace records bench's own job; it cannot be written with --concurrency")
    check_greedy(job.temp)
    check_output_paths({**dict(zip(("--json", "--csv", "--trace", "--plot"), others)), "--save-trace": path})


def _save_trace(path: Path | None, cfg: JobConfig, traced: list | None) -> None:
    if path is not None:
        from ..runtime.job_trace import save_job_trace

        say = _consoles()[1].print
        save_job_trace(path, cfg, traced, lambda text: say(f"pipeinfer bench: {text}", markup=False, highlight=False))


def _relaunch_job(want: int) -> int:
    """Run this bench as an MPI job of `want` ranks, telling it what the terminal is."""
    from ..transport.launch import relaunch

    for stream, var in _TTY_ENV.items():  # the relaunched head cannot see this terminal
        os.environ.setdefault(var, "1" if getattr(sys, stream).isatty() else "0")
    if sys.stdout.isatty():
        os.environ.setdefault("COLUMNS", str(shutil.get_terminal_size().columns))
    return relaunch(want, sys.argv[1:])


def _check_outputs(json_out, csv_out, trace_out, plot_out, concurrency: str | None, parallel: int | None,
                   load_policy: str | None) -> list[int] | None:
    """The output files checked, and the --concurrency levels (None without it) with the options that
    go with it."""
    from ..bench.outputs import check_output_paths
    from ..transport.launch import under_mpi_launcher

    check_output_paths({"--json": json_out, "--csv": csv_out, "--trace": trace_out, "--plot": plot_out})
    _check_plot_support(plot_out)
    if concurrency is None:
        if parallel is not None or load_policy is not None:
            raise UsageError(f"{'--parallel' if parallel is not None else '--load-policy'} sets the server of "
                             "--concurrency; give --concurrency too")
        return None
    from ..decode.parallel_policy import LOAD_POLICIES

    if load_policy is not None and load_policy not in LOAD_POLICIES:
        raise UsageError(f"--load-policy {load_policy!r} is not one of {', '.join(LOAD_POLICIES)}")
    from ..bench.concurrency import parse_levels

    levels = parse_levels(concurrency)
    given = [name for name, v in (("--csv", csv_out), ("--trace", trace_out), ("--plot", plot_out)) if v is not None]
    if given:
        raise UsageError(f"{', '.join(given)} cannot be written with --concurrency (the requests run in a server, "
                         "not in bench's job); use --json")
    if under_mpi_launcher():
        raise UsageError("--concurrency starts its own `pipeinfer serve` job; run bench without mpiexec (use --ranks)")
    return levels


def _bench_under_load(model, job, cfg: JobConfig, target, draft_ref, needs_draft, mode_list, levels, server, prompt_set,
                      prompts_file, repeat, warmup, ranks, json_out, allow_mismatch) -> None:
    """--concurrency: the plan checked here (a split that cannot work fails now), then the load.
    server: the server's (--parallel, --load-policy or None)."""
    from ..models.registry import load_registry
    from .bench_serve import run_concurrency
    from ..planner.job_plan import layout_of

    if not needs_draft:
        cfg = replace(cfg, draft_path=None, draft=DraftSpec.none())  # the server loads no draft model either
    layout_of(cfg, ranks, 1, needs_draft)  # the server's plan, from the GGUF header: a split that cannot work
    pairs = load_registry().pairs
    # A pair name would make the server load the pair's draft; a mode that needs none gets the target alone.
    serve_model = pairs[model].target if model in pairs and not needs_draft else model
    run_concurrency(serve_model=serve_model, job=job, cfg=cfg, target=target, draft_ref=draft_ref,
                    needs_draft=needs_draft, mode_list=mode_list, levels=levels, parallel=server[0],
                    load_policy=server[1],
                    prompt_set=prompt_set, prompts_file=prompts_file, repeat=repeat, warmup=warmup, ranks=ranks,
                    json_out=json_out, allow_mismatch=allow_mismatch, consoles=_consoles())


def _run(cfg: JobConfig, items, traced: list | None = None) -> list[dict] | None:
    """Run the schedule on this rank, with progress on the head; the head gets the records (and in
    `traced` the results that recorded a trace, with --save-trace)."""
    from mpi4py import MPI

    from ..bench.runner import run_bench
    from ..planner.record import CHAIN_DEPTH

    head = MPI.COMM_WORLD.Get_rank() == 0
    progress = _Progress(_consoles()[1], len(items)) if head else None
    try:
        return run_bench(cfg, items, on_record=progress.record if progress else None, results_out=traced,
                         trace_depth=CHAIN_DEPTH if traced is not None else None)
    finally:
        if progress:
            progress.stop()


def _report(res, records: list[dict], mode_list: list[str], per_prompt: bool, outputs: dict, allow_mismatch: bool) -> None:
    """Tables on stdout, files written, and a TokenMismatchError if modes disagreed."""
    from ..bench.report import mode_table, prompt_table
    from ..bench.results import write_outputs
    from ..bench.runner import describe_mismatch

    out_console, err_console = _consoles()
    out_console.print(mode_table(res.summary, mode_list, res.title()))
    if per_prompt:
        out_console.print(prompt_table(records, mode_list, set(res.mismatched_prompts)))
    written = write_outputs(res, outputs["json"], outputs["csv"], outputs["trace"], outputs["plot"])
    for path in written:
        err_console.print(f"wrote {path}", markup=False, highlight=False)
    if not res.mismatches:
        return
    for m in res.mismatches:
        err_console.print(f"TOKENS DIFFER: {describe_mismatch(m)}", style="bold red", markup=False, highlight=False)
    if allow_mismatch:
        err_console.print(f"Warning: modes generated different tokens on {plural(len(res.mismatched_prompts), 'prompt')}; "
                          "exiting 0 because of --allow-mismatch", style="bold red", markup=False, highlight=False)
        return
    raise TokenMismatchError(
        f"modes generated different tokens on {plural(len(res.mismatched_prompts), 'prompt')} "
        f"({', '.join(res.mismatched_prompts)}); speculation must be lossless — the results above are flagged"
        + (" and the outputs record it (tokens_identical: false)" if written else ""))


def _consoles():
    """stdout/stderr consoles that behave as the user's terminal does, also inside mpiexec."""
    from rich.console import Console

    def force(var: str) -> bool | None:
        v = os.environ.get(var)
        return None if v is None else v == "1"

    tty = force(_TTY_ENV["stdout"])
    if tty is None:
        tty = sys.stdout.isatty()
    # Into a file or pipe, never wrap the table: scripts and logs read it whole.
    return (Console(soft_wrap=False, force_terminal=tty, width=None if tty else NON_TTY_WIDTH),
            Console(stderr=True, soft_wrap=True, force_terminal=force(_TTY_ENV["stderr"])))


class _Progress:
    """A bar over prompts × modes × repeats on a terminal; one log line per request otherwise."""

    def __init__(self, console, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console, self.total, self.done = console, total, 0
        self.bar = None
        if console.is_terminal:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TextColumn("{task.fields[last]}"), console=console)
            self.task = self.bar.add_task("bench: loading models", total=total, last="")
            self.bar.start()

    def record(self, rec: dict) -> None:
        self.done += 1
        tps = rec.get("tok_per_s")
        what = (f"{rec['prompt_id']} · {rec['mode']} · {'warmup' if rec['warmup'] else 'repeat'} {rec['repeat']}: "
                f"{plural(rec['n_gen'], 'token')}" + (f", {tps:.2f} tok/s" if tps else ""))
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description="bench", last=what)
        else:
            self.console.print(f"bench [{self.done}/{self.total}] {what}", markup=False, highlight=False)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


