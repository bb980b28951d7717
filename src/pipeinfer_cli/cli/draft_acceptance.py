"""A draft model's acceptance against the target, as `calibrate --draft MODEL` measures it on the
head for -M auto (planner/acceptance.py reads it from the profile): where the whole target fits,
against its greedy tokens; where it does not, with the target a slice of its layers at a time on the
draft's greedy path; where neither can run, not at all, and the profile says why."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..decode.drafters import Drafter
    from ..planner.profile import DraftCosts
    from ..planner.job_config import JobConfig

# What a draft model's acceptance is measured after: a chat request where the target has a chat
# template (what `--chat`, `chat` and `serve` send: an answer accepts more of a draft than a raw
# continuation does, 0.94 against 0.69 for the Qwen pair, BENCHMARKS.md), else the raw text, code and
# prose as the shipped prompt sets mix them.
CALIBRATION_REQUEST = "Write a Python function that returns the n-th Fibonacci number, then explain how it works."
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
    calibration_prompt() by the whole target in this process, and the draft's greedy next token after
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

    available = host_facts().mem_available_bytes
    room = MEMORY_USE * available
    whole = cfg.model_path.stat().st_size <= room and cfg.draft_path.stat().st_size <= room
    slices = None if whole else target_slices(read_model_info(cfg.model_path), room)
    if not whole and (slices is None or cfg.draft_path.stat().st_size > room):
        _not_measured(draft, say, f"neither the draft ({cfg.draft_path.stat().st_size / 1e6:.0f} MB) nor one layer "
                      f"of the target with it fits in {MEMORY_USE:.0%} of this host's available memory "
                      f"({available / 1e6:.0f} MB)")
        return
    tok = Tokenizer(cfg.model_path)
    try:
        prompt, what = calibration_prompt(tok)
        threads, n_ctx = os.cpu_count() or 1, len(prompt) + n_gen + 8
        how = "" if whole else f", the target in {len(slices)} slices of its layers (it does not fit whole)"
        say(f"draft acceptance: {draft.name} against the target, {n_gen} tokens of {what}{how}")
        if whole:
            right, wrong = _whole_target_agreement(cfg, tok, prompt, n_gen, n_ctx, threads)
        else:
            right, wrong = _sliced_target_agreement(cfg, tok, slices, prompt, n_gen, n_ctx, threads)
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


def calibration_prompt(tok) -> tuple[list[int], str]:
    """The tokens acceptance is measured after, and how to name them: CALIBRATION_REQUEST as a chat
    request where the target has a chat template, else CALIBRATION_TEXT as it is."""
    from ..runtime.tokenizer import NoChatTemplateError

    try:
        return tok.chat_messages([{"role": "user", "content": CALIBRATION_REQUEST}]), "a calibration chat request"
    except NoChatTemplateError:
        return tok.encode(CALIBRATION_TEXT), "a calibration prompt (the target has no chat template)"


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


def _sliced_target_agreement(cfg: JobConfig, tok, slices, prompt: list[int], n_gen: int, n_ctx: int, threads: int):
    """(right, wrong) on the draft's greedy path, the target a slice at a time (measure_draft_acceptance);
    (None, None) for a draft of another vocabulary."""
    from ..decode.drafters import LlamaDrafter
    from ..runtime.vocab import draft_vocab

    drafter = LlamaDrafter(cfg.draft_path, n_ctx=n_ctx, n_threads=threads)
    try:
        if draft_vocab(tok, drafter) != "direct":
            return None, None
        path, probs = _draft_path(drafter, prompt, n_gen, tok.is_eog)
    finally:
        drafter.close()
    return sliced_agreement(cfg.model_path, slices, path, len(prompt), probs, n_ctx, threads)


def _draft_path(drafter: Drafter, prompt: list[int], n_gen: int, is_eog) -> tuple[list[int], list[float]]:
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