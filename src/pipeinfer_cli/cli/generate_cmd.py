"""`pipeinfer generate`: one generation request across MPI ranks, streamed to stdout."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..errors import UsageError
from ..registry import load_registry
from .console import err, out
from .options import JsonFlag

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


def resolve_models(model: str, draft: str | None, mode: str, allow_pull: bool):
    """(target ModelRef, draft ModelRef | 'lookup' | None) from a model/pair name or paths."""
    from ..cache import cached_model_path
    from ..fetch import pull_model
    from ..model_files import resolve_model
    from .console import byte_progress

    reg = load_registry()
    if model in reg.pairs:
        pair = reg.pairs[model]
        model, draft = pair.target, draft or pair.draft

    def ref(name: str):
        if allow_pull and name in reg.models and not cached_model_path(reg.models[name]).exists():
            entry = reg.models[name]
            with byte_progress() as progress:
                task = progress.add_task(f"pull {name}", total=entry.size)
                pull_model(entry, progress=lambda n: progress.advance(task, n))
        return resolve_model(name, reg)

    target = ref(model)
    if draft is None or draft == "lookup":
        return target, draft
    return target, ref(draft)


def generate(
    model: Annotated[str, typer.Argument(help="Target model: registry name, pair name (target + draft), or .gguf path.")],
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Raw prompt text.")] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Read the raw prompt from a file.")] = None,
    chat: Annotated[str | None, typer.Option("--chat", help="A user message, formatted with the model's chat template.")] = None,
    draft: Annotated[str | None, typer.Option("--draft", "-md", help="Draft model (name or .gguf path), or 'lookup' for prompt-lookup drafting.")] = None,
    mode: Annotated[str, typer.Option("--mode", "-m", help=MODE_HELP)] = "iterative",
    n_predict: Annotated[int, typer.Option("--n-predict", "-n", min=1, help="Tokens to generate (stops earlier at end of generation).")] = 128,
    temp: Annotated[float, typer.Option("--temp", min=0.0, help="Temperature; 0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", min=0, help="Sample among the k most likely tokens (0 = all).")] = 40,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling threshold (1 = off).")] = 0.95,
    seed: Annotated[int, typer.Option("--seed", "-s", help="Sampling seed; each token depends only on (logits, seed, position).")] = 0,
    n_draft: Annotated[int, typer.Option("--n-draft", min=1, max=64, help="Max draft tokens per speculative run.")] = 4,
    p_min: Annotated[float, typer.Option("--p-min", min=0.0, max=1.0, help="speculative: stop drafting when the draft's top probability is below this.")] = 0.0,
    p_accept: Annotated[float, typer.Option("--p-accept", "-pa", min=0.0, max=1.0, help="pipeinfer: keep speculating while draft confidence >= p_accept + p_adjust.")] = 0.5,
    p_split: Annotated[float, typer.Option("--p-split", "-ps", min=0.0, max=1.0, help="pipeinfer: open a tree branch when a runner-up draft token has p > p_split.")] = 0.1,
    p_recovery: Annotated[float, typer.Option("--p-recovery", "-pr", min=0.0, help="pipeinfer: p_adjust grows by this per run launched this round.")] = 0.0,
    p_decay: Annotated[float, typer.Option("--p-decay", "-pd", min=0.0, help="pipeinfer: p_adjust shrinks by this per rejected run.")] = 0.0,
    max_branches: Annotated[int, typer.Option("--max-branches", min=1, max=8, help="pipeinfer: sequences a token tree may use (1 = no trees).")] = 1,
    max_inflight: Annotated[int, typer.Option("--max-inflight", min=1, max=32, help="pipeinfer: runs in flight at once.")] = 4,
    ranks: Annotated[int | None, typer.Option("--ranks", "-r", min=1, help="Ranks to start with mpiexec on this machine (default: the MPI world size, or 1).")] = None,
    layer_split: Annotated[str | None, typer.Option("--layer-split", help="Fractions of the layers per target stage, '/1' for a draft rank: 0.5,0.5 or 0.5,0.5/1. Default: balanced by bytes.")] = None,
    threads: Annotated[str | None, typer.Option("--threads", "-t", help="Threads per rank: one value or one per rank (default: cores / ranks on this host).")] = None,
    ctx: Annotated[int, typer.Option("--ctx", "-c", min=16, help="Context size (KV cells) per rank.")] = 4096,
    as_json: JsonFlag = False,
) -> None:
    """Generate text from a prompt, with the model's layers split across MPI ranks.

    Text streams to stdout as tokens are committed; a summary (tokens/s, TTFT, acceptance) goes
    to stderr. With --json, one JSON object with the text, the token ids and every metric.
    """
    from ..engine.job import MODES
    from ..engine.topology import parse_layer_split
    from ..transport.launch import RELAUNCHED, relaunch, under_mpi_launcher

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
    split_ranks = None
    if layer_split:
        fractions, n_draft_ranks = parse_layer_split(layer_split)
        split_ranks = len(fractions) + n_draft_ranks
        if ranks is not None and ranks != split_ranks:
            raise UsageError(f"--layer-split {layer_split!r} describes {split_ranks} ranks but --ranks is {ranks}")
    inside = under_mpi_launcher()
    target, draft_ref = resolve_models(model, draft, mode, allow_pull=not inside)
    if mode != "iterative" and draft_ref is None:
        raise UsageError(f"--mode {mode} needs a draft: pass --draft MODEL, --draft lookup, or a pair name such as qwen-coder")

    want = ranks or split_ranks or 1
    if not inside and want > 1:
        raise typer.Exit(relaunch(want, sys.argv[1:]))

    from mpi4py import MPI

    from ..engine.job import JobConfig, Request, run_job
    from ..engine.sampling import SamplingParams
    from ..engine.session import DecodeOptions

    world = MPI.COMM_WORLD.Get_size()
    if (ranks or split_ranks) and world != want and not os.environ.get(RELAUNCHED):
        raise UsageError(f"the MPI job has {world} ranks but the options ask for {want}; start it with -n {want}")
    cfg = JobConfig(
        model_path=target.path, model_label=target.label,
        draft_path=None if draft_ref in (None, "lookup") else draft_ref.path,
        draft_label=draft_ref if draft_ref in (None, "lookup") else draft_ref.label,
        sampling=SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, seed=seed),
        decode=DecodeOptions(n_predict=n_predict, n_draft=n_draft, p_min=p_min, p_accept=p_accept, p_split=p_split,
                             p_recovery=p_recovery, p_decay=p_decay, max_branches=max_branches, max_inflight=max_inflight),
        n_ctx=ctx, layer_split=layer_split, threads=threads,
        debug=os.environ.get("PIPEINFER_DEBUG", "") not in ("", "0"),
    )
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
