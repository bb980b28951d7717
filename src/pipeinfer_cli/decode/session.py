"""The committed state of one generation at the head: tokens, stopping rules, streaming, metrics."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .metrics import GenerationMetrics, now
from .sampling import SamplingParams
from .text_stream import TextStream

SPEC_POLICIES = ("auto", "always")  # DecodeOptions.spec_policy
CANONICAL_SEQ = 0  # the KV sequence that holds committed tokens on every stage
PREFILL_CHUNK = 256  # the largest prompt chunk: every chunk from position 512 on
# The sizes of the first prompt chunks, at fixed positions (0, 16, 32, 48, 64, 96, 128, 192, 256, 384,
# 512, then every 256). Small chunks first let a short prompt fill a pipeline: chunk i+1 computes on
# one stage while chunk i is on the next, so a 60-token prompt on 4 stages is 4 chunks in flight rather
# than one batch walking the stages one after another. On these CPUs a prompt token costs about the same
# in a chunk of 16 as in one of 256 (BENCHMARKS.md, "Prompt chunks"). The positions never depend on
# the prompt, the ranks or the mode, so every job computes the same cells (lossless across host
# counts) and a prefix reused up to a chunk boundary is what a fresh prefill computes. `--ubatch N`
# (DecodeOptions.ubatch) chunks the prompt as llama.cpp does instead: N tokens at a time from
# position 0, so that the prompt's cells, and so the greedy tokens, are llama.cpp's (docs/modes.md).
PREFILL_HEAD = (16, 16, 16, 16, 32, 32, 64, 64, 128, 128)


def prefill_chunks(start: int, end: int, ubatch: int | None = None) -> list[tuple[int, int]]:
    """The prompt chunks [b, e) that cover positions start..end, start being a chunk boundary.
    ubatch: chunks of that many tokens from position 0, as llama.cpp batches a prompt (its -ub);
    None: the small-first chunks of PREFILL_HEAD, then PREFILL_CHUNK."""
    out, b = [], 0
    sizes = iter(PREFILL_HEAD if ubatch is None else ())
    step = PREFILL_CHUNK if ubatch is None else ubatch
    while b < end:
        e = b + next(sizes, step)
        if e > start:
            if b < start:
                raise ValueError(f"prefill from {start}: not a chunk boundary")
            out.append((b, min(e, end)))
        b = e
    return out


def chunk_floor(n: int, ubatch: int | None = None) -> int:
    """The last chunk boundary at or before n (the prompt tokens whole chunks cover)."""
    b = 0
    sizes = iter(PREFILL_HEAD if ubatch is None else ())
    step = PREFILL_CHUNK if ubatch is None else ubatch
    while True:
        e = b + next(sizes, step)
        if e > n:
            return b
        b = e


@dataclass
class DecodeOptions:
    """Knobs of the decoding modes (documented in `pipeinfer generate --help`)."""

    n_predict: int = 128
    n_draft: int = 4  # max draft tokens per speculative run
    n_min: int = 0  # a draft shorter than this is not verified (llama.cpp's --draft-min; 0 and 1: any draft)
    p_min: float = 0.0  # speculative: stop drafting when the draft's top probability is lower
    p_accept: float = 0.5  # pipeinfer: keep speculating while draft confidence >= p_accept + p_adjust
    p_split: float = 0.1  # pipeinfer: split a tree branch when a runner-up candidate has p > p_split
    p_recovery: float = 0.0  # pipeinfer: p_adjust grows by this per run launched this round
    p_decay: float = 0.0  # pipeinfer: p_adjust shrinks by this per rejection
    max_branches: int = 1  # pipeinfer: sequences a token tree may use (1 = no trees)
    max_inflight: int = 4  # pipeinfer: runs in flight at once
    p_reach: float = 0.5  # pipeinfer: draft a token only while acceptance^(tokens ahead) >= p_reach (draft_budget.py; 0: no limit)
    spec_policy: str = "auto"  # pipeinfer on one stage: "auto" drafts while it pays (draft_economy.py), "always"
    ubatch: int | None = None  # prompt chunks of this many tokens (--ubatch, llama.cpp's -ub); None: small-first


class Session:
    """One request at the head: the prompt, the committed tokens, and when to stop.

    finish_reason: "stop" (end of generation token or a stop string), "length" (-n reached),
    "cancelled" (`cancelled()` turned true, e.g. the client went away).

    cancelled: polled at each commit; once it returns True the session is done, so every decode
    loop stops at its next commit and drains what it has in flight, as at any end of generation.
    """

    def __init__(self, prompt: list[int], sampling: SamplingParams, n_predict: int,
                 is_eog: Callable[[int], bool], on_token: Callable[[int], None] | None = None,
                 text: TextStream | None = None, on_text: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = now, cancelled: Callable[[], bool] | None = None):
        self.tokens = list(prompt)
        self.n_prompt = len(prompt)
        self.sampling = sampling
        self.n_predict = n_predict
        self.is_eog = is_eog
        self.on_token = on_token
        self.text = text
        self.on_text = on_text
        self.done = n_predict <= 0
        self.finish_reason: str | None = "length" if self.done else None
        self.clock = clock  # wall time here; a simulated pipeline passes its virtual time
        self.cancelled = cancelled
        self.metrics = GenerationMetrics(n_prompt=len(prompt), t_start=clock())

    @property
    def n_gen(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def remaining(self) -> int:
        return self.n_predict - self.n_gen

    def commit(self, new_tokens: list[int]) -> int:
        """Append tokens (stopping at end-of-generation or -n); return how many were taken."""
        taken = 0
        for t in new_tokens:
            if self.done:
                break
            self.tokens.append(t)
            taken += 1
            if self.on_token:
                self.on_token(t)
            if self.text is not None:
                shown = self.text.push(t)
                if shown and self.on_text:
                    self.on_text(shown)
            if self.is_eog(t) or (self.text is not None and self.text.stopped):
                self.done, self.finish_reason = True, "stop"
            elif self.n_gen >= self.n_predict:
                self.done, self.finish_reason = True, "length"
        if not self.done and self.cancelled is not None and self.cancelled():
            self.done, self.finish_reason = True, "cancelled"
        self.metrics.committed(taken, self.clock())
        return taken

    def replay(self, tokens: Sequence[int]) -> None:
        """Commit tokens the caller has shown already (a resumed request's): the text stream takes
        them so that what it holds back and cuts continues exactly, but nothing is shown or
        reported token by token again."""
        on_token, on_text = self.on_token, self.on_text
        self.on_token = self.on_text = None
        try:
            self.commit(list(tokens))
        finally:
            self.on_token, self.on_text = on_token, on_text

    def finish_text(self) -> None:
        """Show the text still held back (end of generation)."""
        if self.text is not None:
            rest = self.text.finish()
            if rest and self.on_text:
                self.on_text(rest)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.n_prompt:]
