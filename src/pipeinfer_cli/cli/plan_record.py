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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from ..decode.draft_spec import LOOKUP, MODEL
from ..errors import UsageError
from ..planner.record import CHAIN_DEPTH
from .console import err

if TYPE_CHECKING:
    from ..runtime.job_config import JobConfig
    from ..planner.profile import DraftCosts


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


# The raw text (no chat template: every model has a tokenizer, not every one a template) a draft
# model's acceptance is measured after: code and prose, as the shipped prompt sets mix them.
CALIBRATION_TEXT = (
    "Write a Python function that returns the n-th Fibonacci number, then explain how it works.\n\n"
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "The function keeps the last two numbers of the sequence and")


def measure_draft_acceptance(cfg: JobConfig, draft: DraftCosts, n_gen: int, say: Callable[[str], None]) -> None:
    """`calibrate --draft MODEL` on the head: the draft's acceptance against the target on a
    calibration prompt, into the profile's `draft` (DraftCosts); where it was not measured, the
    reason, in `draft.acceptance_note` and on stderr. say(line): progress on stderr.

    The target and the draft run one after the other, never both at once. Where the whole target
    fits in MEMORY_USE of this host's available memory: n_gen tokens generated greedily after
    CALIBRATION_TEXT by the whole target in this process, and the draft's greedy next token after
    every prefix of them (the rate a speculative run meets). Where only a slice of its layers fits
    at a time: the draft generates n_gen tokens greedily, and the target reads the prompt and those
    tokens in one pass, a slice of its layers loaded at a time (each slice's hidden states are the
    next one's input), which gives its greedy token after every prefix of the draft's text; the rate
    is how often the two agree there (on the draft's path, not the target's: the same per-token
    agreement, measured without the whole target in memory). Skipped, and said, where not even the
    draft and one layer fit, or the draft has another vocabulary."""
    from ..models.gguf_info import read_model_info
    from ..runtime.host_facts import host_facts
    from ..runtime.tokenizer import Tokenizer
    from ..runtime.vocab import draft_vocab
    from ..decode.drafters import LlamaDrafter

    room = MEMORY_USE * host_facts().mem_available_bytes
    info = read_model_info(cfg.model_path)
    whole = cfg.model_path.stat().st_size <= room and cfg.draft_path.stat().st_size <= room
    slices = None if whole else target_slices(info, room)
    if not whole and (slices is None or cfg.draft_path.stat().st_size > room):
        _not_measured(draft, say, f"neither the draft ({cfg.draft_path.stat().st_size / 1e6:.0f} MB) nor one layer "
                      f"of the target with it fits in {MEMORY_USE:.0%} of this host's available memory "
                      f"({host_facts().mem_available_bytes / 1e6:.0f} MB)")
        return
    tok = Tokenizer(cfg.model_path)
    try:
        prompt = tok.encode(CALIBRATION_TEXT)
        threads, n_ctx = os.cpu_count() or 1, len(prompt) + n_gen + 8
        how = "" if whole else f", the target in {len(slices)} slices of its layers (it does not fit whole)"
        say(f"draft acceptance: {draft.name} against the target, {n_gen} tokens of a calibration prompt{how}")
        if whole:
            right, wrong = _whole_target_agreement(cfg, tok, prompt, n_gen, n_ctx, threads)
        else:
            path = None
            drafter = LlamaDrafter(cfg.draft_path, n_ctx=n_ctx, n_threads=threads)
            try:
                if draft_vocab(tok, drafter) == "direct":
                    path, probs = _draft_path(drafter, prompt, n_gen, tok.is_eog)
            finally:
                drafter.close()
            right = wrong = None
            if path is not None:
                right, wrong = sliced_agreement(cfg.model_path, slices, path, len(prompt), probs, n_ctx, threads)
    finally:
        tok.close()
    if right is None:
        _not_measured(draft, say, "the draft has another vocabulary than the target")
        return
    n = len(right) + len(wrong)
    if n:
        draft.acceptance, draft.acceptance_tokens = len(right) / n, n
        draft.confidence_right, draft.confidence_wrong = right, wrong
        say(f"draft acceptance: {len(right)}/{n} ({len(right) / n:.0%})")
    else:
        _not_measured(draft, say, "the draft proposed no token on the calibration prompt")


MEMORY_USE = 0.8  # of this host's available memory, for the one model (or slice) loaded at a time


def _not_measured(draft: DraftCosts, say: Callable[[str], None], why: str) -> None:
    draft.acceptance_note = why
    say(f"draft acceptance not measured: {why} (-M auto will assume it, and say so)")


def _whole_target_agreement(cfg: JobConfig, tok, prompt: list[int], n_gen: int, n_ctx: int, threads: int):
    """(right, wrong) probabilities of the draft's next token after every prefix of the whole
    target's greedy tokens; (None, None) for a draft of another vocabulary."""
    from ..decode.drafters import LlamaDrafter
    from ..decode.sampling import SamplingParams
    from ..models.gguf_info import read_model_info
    from ..native import LayerEngine
    from ..planner.record import draft_agreement, target_tokens
    from ..runtime.vocab import draft_vocab

    engine = LayerEngine(str(cfg.model_path), 0, read_model_info(cfg.model_path).n_layer, n_ctx=n_ctx,
                         n_threads=threads, n_seq_max=2)
    toks, _ = target_tokens(engine, prompt, n_gen, tok.is_eog, SamplingParams())
    del engine
    drafter = LlamaDrafter(cfg.draft_path, n_ctx=n_ctx, n_threads=threads)
    try:
        if draft_vocab(tok, drafter) != "direct":
            return None, None
        return draft_agreement(drafter, prompt + toks, len(prompt))
    finally:
        drafter.close()


def _draft_path(drafter, prompt: list[int], n_gen: int, is_eog) -> tuple[list[int], list[float]]:
    """The draft's greedy tokens after the prompt (and the probability of each), up to its end of text."""
    path, probs = list(prompt), []
    drafter.start(path)
    for _ in range(n_gen):
        prop = drafter.propose(path, 1, 0.0)
        if not prop.tokens:
            break
        path.append(prop.tokens[0])
        probs.append(prop.probs[0])
        if is_eog(prop.tokens[0]):
            break
    return path, probs


def target_slices(info, room: float) -> list[tuple[int, int]] | None:
    """Consecutive layer ranges of the target, each of whose weights (the token embeddings on the
    first, the LM head and the rest on the last) fit in `room` bytes; None where one layer does not."""
    out, b, n = [], 0, info.n_layer
    while b < n:
        e, size = b, info.token_embd_bytes if b == 0 else 0
        while e < n and size + info.layer_bytes[e] + (info.output_bytes + info.other_bytes if e == n - 1 else 0) <= room:
            size += info.layer_bytes[e]
            e += 1
        if e == b:
            return None
        out.append((b, e))
        b = e
    return out


def sliced_agreement(model_path, slices: list[tuple[int, int]], full: list[int], start: int, probs: list[float],
                     n_ctx: int, threads: int) -> tuple[list[float], list[float]]:
    """The target's greedy token after every prefix full[:i] (i >= start), one pass over `full`
    with a slice of its layers loaded at a time; (probabilities of the draft's tokens full[start:]
    it agrees with, of those it does not)."""
    import numpy as np

    from ..native import LayerEngine

    pos = np.arange(len(full), dtype=np.int32)
    seqs = [[0]] * len(full)
    output = np.zeros(len(full), dtype=bool)
    output[start - 1:len(full) - 1] = True  # row i - 1's logits give the token at i
    hidden = None
    for b, e in slices:
        engine = LayerEngine(str(model_path), b, e, n_ctx=n_ctx, n_threads=threads, n_seq_max=1)
        hidden = engine.eval(tokens=full if b == 0 else None, embd=None if b == 0 else hidden, pos=pos, seq_ids=seqs,
                             output=output)
        del engine
    guesses = np.argmax(hidden, axis=1)
    right, wrong = [], []
    for i, g in enumerate(guesses):
        (right if int(g) == full[start + i] else wrong).append(round(probs[i], 6))
    return right, wrong