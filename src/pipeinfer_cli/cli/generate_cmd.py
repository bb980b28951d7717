"""`pipeinfer generate`: one generation request across MPI ranks, streamed to stdout."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..decode.result import GenerationResult
from ..planner.layout import format_layer_ranges
from .console import err, out
from .job_options import JobOptions, job_options
from .job_setup import begin_job, check_chat_template, run_here_or_relaunch
from .options import JsonFlag, ModelOption, ModeOption, OptionalModelArg, SaveTraceOption, StopOption
from .prompt_input import check_stop_strings, read_prompt_input
from .wording import epilog, plural

if TYPE_CHECKING:
    from ..planner.job_plan import JobPlan
    from ..runtime.job_config import Request

EPILOG = epilog("""Examples:

  pipeinfer generate smollm2-135m-instruct -p "The capital of France is" -n 32

  pipeinfer generate -m qwen-coder --chat "Write FizzBuzz in Python" -n 64 \\
      --ranks 2

  pipeinfer generate qwen2.5-coder-1.5b-instruct --draft lookup --ranks 2 \\
      -f prompt.txt

  pipeinfer generate qwen2.5-coder-1.5b-instruct --ranks 2 \\
      --draft lookup+smollm2-135m-instruct -f prompt.txt

  pipeinfer generate qwen-coder --system "Review this patch." \\
      --chat "$(git diff)" -n -1

  cat notes.txt | pipeinfer generate smollm2-135m-instruct -f - -n 64 \\
      --stop "###"

  mpirun -hostfile hosts -n 4 pipeinfer generate qwen-coder \\
      --layer-split 0.2,0.4,0.4/1 --chat "Hi"

A registry model that is not downloaded yet is pulled first (one line on stderr says what, how
big and where); --no-pull or PIPEINFER_NO_PULL=1 refuses.

With a draft (--draft, or a pair name such as qwen-coder) the mode is pipeinfer unless -M says
otherwise. A draft of another family (another vocabulary) is translated through text: its proposals
are re-tokenized for the target, which verifies its own tokens (the summary line says "draft
translated"). --draft suffix drafts from the longest earlier match in the prompt and the answer so
far (and, in chat, serve and bench, in the job's earlier requests), no model. --draft lookup+MODEL
or suffix+MODEL drafts by lookup or suffix where it has a confident match and with MODEL elsewhere;
the summary line counts each source's accepted tokens.

Greedy decoding (--temp 0, the default) prints exactly the same tokens in every mode; with
--temp > 0 the same --seed also gives the same tokens in every mode.

--save-trace FILE keeps the run as a trace that `pipeinfer plan --trace FILE` replays (the
prompt's and the committed tokens, and a draft model's greedy chains from every committed prefix,
asked of the job's draft after the run): the acceptance of a real distributed run, for plans.

--messages takes a JSON list of {"role": "system"|"user"|"assistant", "content": "..."} objects.
""")


@job_options
def generate(
    model: OptionalModelArg = None,
    model_opt: ModelOption = None,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Raw prompt text.")] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Read the raw prompt from a file ('-': standard input).")] = None,
    chat: Annotated[str | None, typer.Option("--chat", help="A user message, formatted with the model's chat template.")] = None,
    messages: Annotated[Path | None, typer.Option("--messages", help="Chat messages from a JSON file ('-': standard input), formatted with the model's chat template.")] = None,
    system: Annotated[str | None, typer.Option("--system", help="System prompt, with --chat or --messages.")] = None,
    mode: ModeOption = None,
    stop: StopOption = None,
    job: JobOptions = None,
    as_json: JsonFlag = False,
    save_trace: SaveTraceOption = None,
) -> None:
    """Generate text from a prompt, with the model's layers split across MPI ranks.

    Text streams to stdout as tokens are committed; a summary line goes to stderr.

    With --json: one JSON object with the text, the token ids and every metric.
    """
    def read_input(inside: bool):
        # Only the head reads the prompt: under a launcher, standard input reaches rank 0 alone.
        return read_prompt_input(prompt, file, chat, messages, system) if not inside or world_rank() == 0 else None

    _check_save_trace(save_trace, job)
    start = begin_job(model, model_opt, mode, job, read_input, trace_draft=save_trace is not None)
    plan, given = start.prep.plan, start.given
    cfg = plan.cfg
    if given is not None and given.messages is not None:
        check_chat_template(cfg.model_path, cfg.model_label, "--chat/--messages/--system")
    run_here_or_relaunch(start.prep, start.inside, lambda: _relaunch(plan, given))

    from ..runtime.job import Request

    from ..planner.record import CHAIN_DEPTH

    request = Request(mode=plan.mode, prompt=given.text if given else None, chat=given.messages if given else None,
                      stop=check_stop_strings(stop), trace_depth=CHAIN_DEPTH if save_trace else None)
    _run_and_print(plan, request, as_json, save_trace)


def _check_save_trace(path: Path | None, job) -> None:
    """--save-trace: a greedy run, and a file that can be written (checked before any model loads)."""
    if path is None:
        return
    from ..bench.outputs import check_output_paths
    from ..runtime.job_trace import check_greedy
    from ..transport.start_waits import launcher_rank

    check_greedy(job.temp)
    if launcher_rank() == 0:  # the head writes it: other hosts need not have its directory
        check_output_paths({"--save-trace": path})


# In `iterative` mode one stage computes at a time, so the ranks that `--ranks N` starts may each
# use every CPU their host grants them (runtime/topology.py, WHOLE_HOST_ENV), their OpenMP threads
# spinning briefly between graphs and then sleeping, which beats one thread per rank with passive
# waiting. Each rank counts its own CPUs: on a capped host (a container's or an emulated host's
# --cpus) that is its quota, and it never spins into it (cli/app.py). The speculative modes compute
# on several stages at once: there, oversubscribed spinning threads slow every stage down, so they
# keep their share (BENCHMARKS.md, "Threads per rank").
ITERATIVE_SPIN_COUNT = "10000"


def whole_host_threads(mode_drafts: bool, threads: str | None) -> bool:
    """Whether the ranks of a job this command starts should each take every CPU their host grants
    (iterative mode, no --threads, no OMP_WAIT_POLICY of the user's). mode_drafts: the job's mode
    drafts (the plan's `mode_drafts`, decode/modes.needs_draft)."""
    return not (mode_drafts or threads is not None or "OMP_WAIT_POLICY" in os.environ)


def _relaunch(plan: JobPlan, given) -> int:
    """This command again as an MPI job of the plan's ranks; standard input, already read here,
    reaches the job as a private temporary file. In iterative mode (whole_host_threads) every rank
    takes its host's CPUs, with a brief spin where no quota holds it."""
    from ..runtime.topology import WHOLE_HOST_ENV
    from ..transport.launch import relaunch

    whole_host, n_ranks = whole_host_threads(plan.mode_drafts, plan.cfg.threads), plan.ranks
    argv = sys.argv[1:]
    if whole_host:
        os.environ[WHOLE_HOST_ENV] = "1"  # inherited by the ranks, which read their own CPU share
        os.environ.setdefault("GOMP_SPINCOUNT", ITERATIVE_SPIN_COUNT)
    if given.stdin_text is None:
        return relaunch(n_ranks, argv)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", prefix="pipeinfer-stdin-", suffix=".txt") as f:
        f.write(given.stdin_text)
        f.flush()
        return relaunch(n_ranks, _stdin_as_file(argv, f.name))


def _run_and_print(plan: JobPlan, request: Request, as_json: bool, save_trace: Path | None = None) -> None:
    """Run the job's plan on this rank; the head streams the text (or prints the JSON) and the
    summary, then saves the trace (--save-trace)."""
    from ..runtime.job import run_job

    cfg, auto = plan.cfg, plan.auto

    def on_text(text: str) -> None:
        if not as_json:
            sys.stdout.write(text)
            sys.stdout.flush()

    results = run_job(plan, [request], on_text=on_text)
    if results is None:  # a worker rank: the head reports
        return
    result = results[0]
    if as_json:
        out.print_json(json.dumps({**result.to_json(), **({"auto": auto.to_json()} if auto else {})}))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        err.print(summary_line(result, auto), markup=False, highlight=False)
    if auto is not None:  # -M auto: what the plan would have chosen at the acceptance the request measured
        from ..planner.replan import hindsight

        line = hindsight(cfg, auto, plan.ranks, result.acceptance.drafted, result.acceptance.accepted)
        if line:
            err.print(line, markup=False, highlight=False)
    if save_trace is not None:
        from ..runtime.job_trace import save_job_trace

        save_job_trace(save_trace, cfg, results,
                       lambda text: err.print(f"pipeinfer: {text}", markup=False, highlight=False))


def _stdin_as_file(argv: list[str], path: str) -> list[str]:
    """argv with '-' (standard input) replaced by path after -f/--file/--messages."""
    out = list(argv)
    for i, a in enumerate(out):
        if a in ("-f", "--file", "--messages") and i + 1 < len(out) and out[i + 1] == "-":
            out[i + 1] = path
        elif a in ("--file=-", "--messages=-"):
            out[i] = a[:-1] + path
    return out


def world_rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def _by_source(acc) -> str:
    """' (lookup 40/42, model 10/20)' for a hybrid draft, else ''."""
    rows = [f"{src} {a}/{d}" for src, (d, a) in sorted(acc.by_source.items())]
    return f" ({', '.join(rows)})" if rows else ""


def _head_cpu(r: GenerationResult) -> str:
    """'head CPU 6.1 s (layers 26%, draft 73%, own 1%)', or '' when the head did not count it."""
    split = r.ranks[0].cpu_split if r.ranks else None
    if split is None or split.total_s <= 0:
        return ""
    shares = [("layers", split.stage_s), ("draft", split.draft_s), ("own", split.own_s)]
    return (f"head CPU {split.total_s:.1f} s ("
            + ", ".join(f"{name} {v / split.total_s:.0%}" for name, v in shares if v > 0 or name != "draft") + ")")


def summary_line(r: GenerationResult, auto=None) -> str:
    parts = [plural(r.n_gen, "token"), f"{r.tok_per_s:.2f} tok/s" if r.tok_per_s else "",
             f"decode {r.decode_tok_per_s:.2f} tok/s" if r.decode_tok_per_s else "",
             f"TTFT {r.ttft_s * 1e3:.0f} ms" if r.ttft_s is not None else ""]
    acc, runs = r.acceptance, r.runs
    if acc.drafted:
        parts.append(f"acceptance {acc.accepted}/{acc.drafted} ({acc.rate:.0%})" + _by_source(acc))
    if r.draft_vocab == "translated" and r.mode != "iterative":
        parts.append("draft translated (another vocabulary)")
    if runs.drafting_ended:
        parts.append("drafting off (cannot pay on one stage; --spec-policy always drafts anyway)")
    elif runs.drafting_paused:
        parts.append(f"drafting paused {plural(runs.drafting_paused, 'time')}")
    if runs.cancelled:
        parts.append(f"{plural(runs.cancelled, 'run')} cancelled")
    if r.drafting.proposed and r.n_gen:
        parts.append(f"{r.drafting.proposed / r.n_gen:.2f} drafted per token")
    parts.append(_head_cpu(r))
    parts.append(f"mode {r.mode}" if auto is None else f"mode {auto.summary(r.tok_per_s)}")
    parts.append(f"{plural(len(r.ranks), 'rank')} (layers {format_layer_ranges([x.layers for x in r.ranks])})")
    return "pipeinfer: " + ", ".join(p for p in parts if p)
