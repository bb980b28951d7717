"""`pipeinfer chat`: an interactive terminal chat on one MPI job (models loaded once)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from ..decode.modes import needs_draft
from ..decode.result import GenerationResult
from ..errors import UsageError
from .generate_cmd import summary_line, world_rank
from .job_options import JobOptions, job_options
from .job_setup import begin_job, run_here_or_relaunch
from .options import ModelOption, ModeOption, OptionalModelArg, StopOption
from .prompt_input import check_stop_strings
from .wording import epilog, plural

if TYPE_CHECKING:
    from ..planner.job_plan import JobPlan

# Set by the launching process, which sees the user's terminal (under mpiexec the head's standard
# streams are pipes from the launcher): "in" if standard input is a terminal (print "> " prompts),
# "out" if standard output and error are both terminals or one and the same file (`2>&1`): then
# everything goes to stdout, in order (the launcher forwards the head's two streams through separate
# pipes, and a summary line could overtake the end of the answer it follows).
TERMINAL_ENV = "PIPEINFER_CHAT_TERMINAL"

EPILOG = epilog("""Examples:

  pipeinfer chat smollm2-135m-instruct

  pipeinfer chat qwen-coder --ranks 2 --system "Be a terse code reviewer."

  pipeinfer chat qwen-coder --layer-split 1/1 -M speculative   # a draft rank

  printf 'Hi\\nWhat did I just say?\\n' | pipeinfer chat smollm2-135m-instruct

Type a message and press Enter; the answer streams, and a summary line (tok/s, TTFT, acceptance,
prompt tokens reused from the previous turn) follows on stderr. /reset starts a new conversation,
/exit or Ctrl-D ends the chat; Ctrl-C stops the whole job at once. With standard input not a
terminal (the last example) the chat reads one message a line, without prompts.

Every turn sends the whole conversation through the model's chat template. The KV caches keep the
previous turn, and a turn reuses only the part of it that is exactly what a fresh prompt pass would
compute: the previous prompt's whole chunks of 256 tokens. A short chat reuses nothing (`reused
0/31`); once the previous prompt holds 256 tokens or more, a turn recomputes at most 255 of them plus
the previous answer and the new message. So answers are the very tokens `pipeinfer generate
--messages` prints for the same conversation, and a long conversation pays mostly for the new turn.
""")


@job_options(n_predict=-1)
def chat(
    model: OptionalModelArg = None,
    model_opt: ModelOption = None,
    system: Annotated[str | None, typer.Option("--system", help="System prompt of the conversation (kept across /reset).")] = None,
    mode: ModeOption = None,
    stop: StopOption = None,
    job: JobOptions = None,
) -> None:
    """Chat with a model in the terminal; the models load once, a turn reuses the previous one's KV cells in whole 256-token chunks.

    Answers stream to stdout; a summary line per answer goes to stderr. Until the previous prompt
    holds 256 tokens nothing is reused (the summary says `reused 0/31 prompt tokens`); see below.
    """
    from ..transport.launch import relaunch

    if model is None and model_opt is None:
        raise UsageError("no model given; pass one, e.g. `pipeinfer chat smollm2-135m-instruct` (see `pipeinfer models list`)")
    start = begin_job(model, model_opt, mode, job, settings={"reuse_prefix": True})
    prep = start.prep
    stops = check_stop_strings(stop)

    def relaunch_job() -> int:
        os.environ[TERMINAL_ENV] = _terminal()  # the relaunched head cannot see this terminal
        return relaunch(prep.ranks, sys.argv[1:])

    run_here_or_relaunch(prep, start.inside, relaunch_job)
    _run(prep.plan, system, stops)


def _run(plan: JobPlan, system: str | None, stops: list[str]) -> None:
    """The chat on this rank of the job that carries out plan (the head reads the conversation)."""
    from ..runtime.job import run_head_loop
    from .chat_session import ChatSession, ChatSettings

    cfg, mode = plan.cfg, plan.mode

    terminal = os.environ.get(TERMINAL_ENV, _terminal()).split(",")
    interactive = "in" in terminal
    settings = ChatSettings(mode=mode, system=system, stop=stops, show_prompt=interactive)
    notes = sys.stdout if "out" in terminal else sys.stderr

    def head_main(head) -> None:
        if interactive:
            draft = f" + draft {cfg.draft_label}" if cfg.draft_label and needs_draft(mode) else ""
            notes.write(f"pipeinfer chat: {cfg.model_label}{draft}, mode {mode}, {plural(head.topo.world_size, 'rank')}. "
                        "/reset starts over, /exit or Ctrl-D ends.\n")
            notes.flush()
        if plan.auto is not None:  # -M auto: each turn's settings, planned again between turns
            from ..planner.replan import Replanner

            settings.replanner = Replanner(cfg, plan.auto, plan.ranks, lambda line: _say(notes, line))
        ChatSession(head, settings, chat_summary, stderr=notes).run()

    if world_rank() != 0:
        sys.stdin.close()  # only the head reads the conversation
    run_head_loop(plan, head_main)


def _say(stream, line: str) -> None:
    stream.write(line + "\n")
    stream.flush()


def _terminal() -> str:
    """Which of this process's standard streams are terminals ("in", "out"; see TERMINAL_ENV)."""
    flags = ["in"] if sys.stdin.isatty() else []
    if (sys.stdout.isatty() and sys.stderr.isatty()) or _one_file(sys.stdout, sys.stderr):
        flags.append("out")
    return ",".join(flags)


def _one_file(a, b) -> bool:
    """True if two streams write to the same open file (e.g. `2>&1` into a pipe or a file)."""
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def chat_summary(result: GenerationResult) -> str:
    """generate's summary line plus the prompt tokens reused from the previous turn."""
    line = summary_line(result)
    reused = f"reused {result.reused_tokens}/{result.n_prompt} prompt tokens"
    head, sep, tail = line.partition(", mode ")
    return f"{head}, {reused}{sep}{tail}" if sep else f"{line}, {reused}"
