"""Prefix reuse between requests: which KV cells of the previous request the next one may keep.

With reuse on (chat, serve), the canonical KV sequence keeps the previous request's committed
tokens (all but the last, which was sampled and never fed) on every stage. The next request keeps
only cells that are bit-identical to what a fresh prefill of its prompt would compute, so that its
tokens are exactly those it would get without reuse:

- a prefill computes the prompt in chunks at fixed positions (0, 16, 32, …, 256, 384, 512, 768, …,
  or every --ubatch tokens: `session.prefill_chunks`)
  with the batched kernels; a cell computed by a *full* chunk depends only on the tokens up to the
  chunk's end, so a later prompt that shares those tokens would compute the very same cell;
- cells of generated tokens were computed one row at a time (batch-invariant decode), and those of
  a prompt's last, partial chunk with a smaller batch: ggml picks other kernels for other row
  counts, so a fresh prefill would round them differently (visibly in the logits: BENCHMARKS.md,
  "Figures formerly quoted in source comments"), and reusing them could change the output.

So the kept prefix is the common token prefix, rounded down to whole chunks, within the part of the
cache that full prefill chunks computed. The suffix is then prefilled in the same chunks a fresh
prefill uses. Pure bookkeeping: the head applies the trim (`seq_rm` on every stage).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .session import chunk_floor


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def whole_chunks(n: int, ubatch: int | None = None) -> int:
    """n rounded down to a prefill chunk boundary (chunks of `ubatch` tokens; None: the small-first ones)."""
    return chunk_floor(n, ubatch)


@dataclass
class PrefixCache:
    """What the canonical KV sequence holds on every stage between requests.

    tokens: the tokens whose cells are in the canonical sequence, positions 0.. (empty: cleared).
    exact: how many leading cells full prefill chunks computed (a chunk boundary); only
        these may be reused.
    min_resume: the shortest prefix the stages can continue from: a sliding-window cache (Gemma 3)
        pruned the cells a shorter one would need (0: any). A shorter prefix is not kept at all.
    ubatch: the job's prompt chunks (--ubatch; None: the small-first ones), whose boundaries these are.
    """

    tokens: list[int] = field(default_factory=list)
    exact: int = 0
    min_resume: int = 0
    ubatch: int | None = None

    def plan(self, prompt: list[int]) -> tuple[int, int]:
        """(tokens to keep, common prefix length) for the next prompt. At least one prompt token is
        always prefilled again: its logits give the first generated token."""
        common = common_prefix(self.tokens, prompt)
        keep = whole_chunks(min(common, self.exact, len(prompt) - 1), self.ubatch)
        return (keep if keep >= self.min_resume else 0), common

    def after_request(self, prompt: list[int], committed: list[int], min_resume: int = 0) -> None:
        """The cache after a request whose prompt was prefilled from a chunk boundary (after the
        kept cells), with `committed` its final tokens; the canonical sequence has been trimmed to
        committed[:-1]."""
        self.tokens = list(committed[:-1])
        # The prompt's full chunks (reused, or computed from a chunk boundary) are exact.
        self.exact = whole_chunks(min(len(prompt), len(self.tokens)), self.ubatch)
        self.min_resume = min_resume

    def clear(self) -> None:
        self.tokens, self.exact, self.min_resume = [], 0, 0
