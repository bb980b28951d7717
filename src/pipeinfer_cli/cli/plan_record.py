"""Recording a plan's trace on this machine: the prompts tokenized as `bench` tokenizes them, the
whole target on one process, and the draft's chains (planner/record.py)."""

from __future__ import annotations

import os
import time

from ..decode.draft_spec import LOOKUP, MODEL
from ..errors import UsageError
from .console import err

CHAIN_DEPTH = 24  # draft tokens recorded from each committed prefix: past n_draft x runs in flight


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
    from ..runtime.calibrate_probes import host_facts

    facts = host_facts()
    machine = {"host": facts.host, "cpu": facts.cpu, "cores": facts.cores, "usable_cpus": facts.usable_cpus,
               "threads": threads}
    model = {"name": setup.label, "file_bytes": setup.path.stat().st_size, "sha256": setup.sha256}
    return Trace(model, draft, {"temp": 0.0, "seed": 0}, CHAIN_DEPTH if with_chains else 0, traces, machine)
