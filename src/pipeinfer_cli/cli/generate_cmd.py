"""`pipeinfer generate`: one generation request across MPI ranks, streamed to stdout."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..errors import UsageError
from .console import err, out
from .job_setup import check_world, make_job_config, ranks_wanted, resolve_models
from .options import (
    CtxOption, DraftOption, JobRanksOption, JsonFlag, LayerSplitOption, MaxBranchesOption, MaxInflightOption,
    ModelArg, NDraftOption, NPredictOption, PAcceptOption, PDecayOption, PMinOption, PRecoveryOption, PSplitOption,
    SeedOption, TempOption, ThreadsOption, TopKOption, TopPOption,
)

MODE_HELP = (
    "iterative: one token per pass through the pipeline. "
    "speculative: draft --n-draft tokens, verify them in one batch (standard synchronous speculation). "
    "pipeinfer: asynchronous pipelined speculation with early cancellation."
)

EPILOG = """Examples:

  pipeinfer generate smollm2-135m-instruct -p "The capital of France is" -n 32

  pipeinfer generate qwen-coder --chat "Write FizzBuzz in Python" -n 64 --ranks 2 --mode speculative

  pipeinfer generate qwen2.5-coder-1.5b-instruct --draft lookup --mode pipeinfer --ranks 2 -f prompt.txt

  mpirun -hostfile hosts -n 4 pipeinfer generate qwen-coder --layer-split 0.2,0.4,0.4/1 --chat "Hi"

Greedy decoding (--temp 0, the default) prints exactly the same tokens in every mode; with
--temp > 0 the same --seed also gives the same tokens in every mode.
"""


def generate(
    model: ModelArg,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Raw prompt text.")] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Read the raw prompt from a file.")] = None,
    chat: Annotated[str | None, typer.Option("--chat", help="A user message, formatted with the model's chat template.")] = None,
    draft: DraftOption = None,
    mode: Annotated[str, typer.Option("--mode", "-m", help=MODE_HELP)] = "iterative",
    n_predict: NPredictOption = 128,
    temp: TempOption = 0.0,
    top_k: TopKOption = 40,
    top_p: TopPOption = 0.95,
    seed: SeedOption = 0,
    n_draft: NDraftOption = 4,
    p_min: PMinOption = 0.0,
    p_accept: PAcceptOption = 0.5,
    p_split: PSplitOption = 0.1,
    p_recovery: PRecoveryOption = 0.0,
    p_decay: PDecayOption = 0.0,
    max_branches: MaxBranchesOption = 1,
    max_inflight: MaxInflightOption = 4,
    ranks: JobRanksOption = None,
    layer_split: LayerSplitOption = None,
    threads: ThreadsOption = None,
    ctx: CtxOption = 4096,
    as_json: JsonFlag = False,
) -> None:
    """Generate text from a prompt, with the model's layers split across MPI ranks.

    Text streams to stdout as tokens are committed; a summary line goes to stderr.

    With --json: one JSON object with the text, the token ids and every metric.
    """
    from ..engine.job import MODES
    from ..transport.launch import relaunch, under_mpi_launcher

    if mode not in MODES:
        raise UsageError(f"unknown --mode {mode!r}; choose one of {', '.join(MODES)}")
    given = [x for x in (prompt, file, chat) if x is not None]
    if len(given) != 1:
        raise UsageError("give exactly one of -p/--prompt, -f/--file or --chat")
    if file is not None:
        try:
            prompt = file.read_text()
        except OSError as e:
            raise UsageError(f"cannot read the prompt file {file}: {e.strerror}") from None
    want, split_ranks = ranks_wanted(ranks, layer_split)
    inside = under_mpi_launcher()
    target, draft_ref = resolve_models(model, draft, mode, allow_pull=not inside)
    if mode != "iterative" and draft_ref is None:
        raise UsageError(f"--mode {mode} needs a draft: pass --draft MODEL, --draft lookup, or a pair name such as qwen-coder")

    if not inside and want > 1:
        raise typer.Exit(relaunch(want, sys.argv[1:]))

    from ..engine.job import Request, run_job

    check_world(want, explicit=bool(ranks or split_ranks))
    cfg = make_job_config(target, draft_ref, n_predict=n_predict, temp=temp, top_k=top_k, top_p=top_p, seed=seed,
                          n_draft=n_draft, p_min=p_min, p_accept=p_accept, p_split=p_split, p_recovery=p_recovery,
                          p_decay=p_decay, max_branches=max_branches, max_inflight=max_inflight, ctx=ctx,
                          layer_split=layer_split, threads=threads)
    stream = {}

    def on_start(tok):
        stream["dec"] = tok.decoder()

    def on_token(t: int):
        if not as_json:
            sys.stdout.write(stream["dec"].push(t))
            sys.stdout.flush()

    request = Request(mode=mode, prompt=prompt, chat=[{"role": "user", "content": chat}] if chat is not None else None)
    results = run_job(cfg, [request], on_start=on_start, on_token=on_token)
    if results is None:  # a worker rank: the head reports
        return
    result = results[0]
    if as_json:
        for r in result["ranks"]:
            r.pop("trace", None)
        out.print_json(json.dumps(result))
    else:
        sys.stdout.write(stream["dec"].flush() + "\n")
        sys.stdout.flush()
        err.print(summary_line(result), markup=False, highlight=False)


def summary_line(r: dict) -> str:
    parts = [f"{r['n_gen']} tokens", f"{r['tok_per_s']:.2f} tok/s" if r.get("tok_per_s") else "",
             f"decode {r['decode_tok_per_s']:.2f} tok/s" if r.get("decode_tok_per_s") else "",
             f"TTFT {r['ttft_s'] * 1e3:.0f} ms" if r.get("ttft_s") is not None else ""]
    acc = r["acceptance"]
    if acc["drafted"]:
        parts.append(f"acceptance {acc['accepted']}/{acc['drafted']} ({acc['rate']:.0%})")
    if r["runs"]["cancelled"]:
        parts.append(f"{r['runs']['cancelled']} runs cancelled")
    parts.append(f"mode {r['mode']}, {len(r['ranks'])} rank(s), split {r['layer_split']}")
    return "pipeinfer: " + ", ".join(p for p in parts if p)
