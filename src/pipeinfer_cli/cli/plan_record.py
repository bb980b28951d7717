"""Recording a plan's trace: on this machine, the prompts tokenized as `bench` tokenizes them, the
whole target on one process, and the draft's chains (planner/record.py); or, with --record-ranks N,
as an MPI job with the target's layers split across N ranks: `pipeinfer generate` (one prompt) or
`pipeinfer bench` (a prompt set) in iterative mode with --save-trace, started as any job of theirs
is (transport/launch.py), so a model that no one process can hold is recorded too."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import typer

from ..decode.draft_spec import LOOKUP, MODEL
from ..errors import UsageError
from ..planner.record import CHAIN_DEPTH
from .console import err


def _say(text: str) -> None:
    err.print(f"pipeinfer plan: {text}", markup=False, highlight=False)


def _prompt_ids(tok, setup, prompt: str | None, prompts: str | None, limit: int | None) -> list[tuple[str, list[int]]]:
    from ..bench.prompts import load_prompts, resolve_prompts

    if prompt is not None and prompts is not None:
        raise UsageError("give -p or --prompts, not both")
    if prompt is not None:
        if not prompt:
            raise UsageError("the prompt is empty; pass some text with -p")
        return [("p", tok.encode(prompt))]
    if prompts is None:
        raise UsageError("nothing to predict for: pass -p TEXT, --prompts SET (as `bench` takes it) or --trace FILE")
    out = []
    for bp in load_prompts(resolve_prompts(prompts), limit):
        ids = tok.chat_messages(list(bp.messages)) if bp.messages is not None else tok.encode(bp.prompt)
        out.append((bp.id, ids))
    return out


def _refuse_translated(tok, setup) -> None:
    """The recorded chains feed the target's token ids to the draft: only a draft of the same vocabulary."""
    from ..runtime.tokenizer import Tokenizer
    from ..runtime.vocab import draft_vocab

    draft_tok = Tokenizer(setup.draft_path)
    try:
        if draft_vocab(tok, draft_tok) == "translated":
            raise UsageError(f"plan --record cannot record the chains of {setup.draft_label}, a draft of another "
                             "vocabulary, yet; predict it with --acceptance RATE instead (bench measures the rate: "
                             "`pipeinfer bench ... --draft " + str(setup.draft_label) + "`)")
    finally:
        draft_tok.close()


def record_trace(setup, prompt: str | None, prompts: str | None, limit: int | None, n_predict: int,
                 with_chains: bool):
    from ..runtime.draft_setup import local_drafter
    from ..decode.sampling import SamplingParams
    from ..native import LayerEngine
    from ..planner.record import draft_chains, target_tokens
    from ..planner.replay import PromptTrace, Trace
    from ..runtime.tokenizer import Tokenizer

    if n_predict < 1:
        raise UsageError("-n must be at least 1 to record a trace")
    tok = Tokenizer(setup.path)
    if with_chains and setup.draft_path is not None:
        _refuse_translated(tok, setup)
    ids = _prompt_ids(tok, setup, prompt, prompts, limit)
    n_ctx = max(len(p) for _, p in ids) + n_predict + CHAIN_DEPTH + 8
    threads = os.cpu_count() or 1
    t0 = time.monotonic()
    _say(f"recording the target's tokens for {len(ids)} prompt(s) on this machine ({setup.label}, {threads} threads)")
    engine = LayerEngine(str(setup.path), 0, setup.profile.model.n_layer, n_ctx=n_ctx, n_threads=threads, n_seq_max=2)
    traces = []
    for pid, p in ids:
        toks, why = target_tokens(engine, p, n_predict, tok.is_eog, SamplingParams())
        traces.append(PromptTrace(pid, p, toks, why))
    del engine
    if with_chains:
        drafter = local_drafter(setup.draft, setup.draft_path, n_ctx, threads)
        try:
            for i, pt in enumerate(traces, start=1):
                _say(f"draft chains for prompt {pt.prompt_id} ({i}/{len(traces)}, {len(pt.tokens)} tokens)")
                draft_chains(drafter, pt, CHAIN_DEPTH)
        finally:
            drafter.close()
    _say(f"trace recorded in {time.monotonic() - t0:.1f} s")
    tok.close()
    draft = None if setup.draft_label is None else {"name": setup.draft_label,
                                                      "kind": LOOKUP if setup.draft.is_lookup else MODEL,
                                                      "sha256": setup.draft_sha256}
    from ..runtime.host_facts import host_facts

    facts = host_facts()
    machine = {"host": facts.host, "cpu": facts.cpu, "cores": facts.cores, "usable_cpus": facts.usable_cpus,
               "threads": threads}
    model = {"name": setup.label, "file_bytes": setup.path.stat().st_size, "sha256": setup.sha256}
    return Trace(model, draft, {"temp": 0.0, "seed": 0}, CHAIN_DEPTH if with_chains else 0, traces, machine)


def job_command(setup, prompt: str | None, prompts: str | None, limit: int | None, n_predict: int,
                with_chains: bool, ranks: int, job: dict, out: Path) -> list[str]:
    """The `pipeinfer generate`/`bench` command that records the trace on a job of `ranks` ranks.
    job: the plan's --layer-split, --threads and --ctx (None: the job's defaults)."""
    if prompt is not None and prompts is not None:
        raise UsageError("give -p or --prompts, not both")
    if prompt is not None and not prompt:
        raise UsageError("the prompt is empty; pass some text with -p")
    if prompt is None and prompts is None:
        raise UsageError("nothing to predict for: pass -p TEXT, --prompts SET (as `bench` takes it) or --trace FILE")
    if n_predict < 1:
        raise UsageError("-n must be at least 1 to record a trace")
    if prompt is not None:
        cmd = ["generate", setup.label, "-M", "iterative", "-p", prompt]
    else:
        cmd = ["bench", setup.label, "--modes", "iterative", "--prompts", prompts, "--warmup", "0", "--repeat", "1"]
        cmd += ["--limit", str(limit)] if limit else []
    cmd += ["-n", str(n_predict), "--ranks", str(ranks), "--no-pull", "--save-trace", str(out)]
    if with_chains or setup.draft.is_lookup:  # a draft model only to record its chains
        cmd += ["--draft", setup.draft_label]
    split = job.get("layer_split")
    if split and "auto" not in split:
        cmd += ["--layer-split", split]
    for opt in ("threads", "ctx"):
        if job.get(opt) is not None:
            cmd += [f"--{opt}", str(job[opt])]
    return cmd


def record_on_job(setup, prompt: str | None, prompts: str | None, limit: int | None, n_predict: int,
                  with_chains: bool, ranks: int, job: dict):
    """The trace recorded by an MPI job of `ranks` ranks (its progress on stderr, its text dropped)."""
    from ..planner.replay import Trace

    if with_chains:
        _refuse_translated_by_path(setup)
    with tempfile.TemporaryDirectory(prefix="pipeinfer-record-") as tmp:
        out = Path(tmp) / "trace.json"
        cmd = job_command(setup, prompt, prompts, limit, n_predict, with_chains, ranks, job, out)
        _say(f"recording the trace on an MPI job of {ranks} ranks: pipeinfer {' '.join(cmd[:2])} ... --save-trace")
        t0 = time.monotonic()
        rc = _run_quietly([sys.executable, "-m", "pipeinfer_cli", *cmd], str(out))
        if rc != 0:
            raise typer.Exit(rc)  # the job said why, in its one `Error:` line
        if not out.is_file():
            raise UsageError(f"the job that recorded the trace on {ranks} ranks wrote no trace")
        _say(f"trace recorded in {time.monotonic() - t0:.1f} s")
        return Trace.load(out)


def _run_quietly(cmd: list[str], temp_path: str) -> int:
    """Run the recording job: its text dropped, its stderr shown but for the line naming the
    temporary trace (plan names the file it writes)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace")
    for line in proc.stderr:
        if temp_path not in line:
            sys.stderr.write(line)
            sys.stderr.flush()
    return proc.wait()


def _refuse_translated_by_path(setup) -> None:
    from ..runtime.tokenizer import Tokenizer

    tok = Tokenizer(setup.path)
    try:
        _refuse_translated(tok, setup)
    finally:
        tok.close()
