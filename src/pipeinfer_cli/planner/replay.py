"""Acceptance replayed, not assumed: a recorded trace answers for the target and the draft.

Decoding is lossless, so the target's tokens for a prompt are the same in every mode: the trace
holds them once (from an iterative run). The draft model is greedy and deterministic, so what it
proposes depends on the path alone; every path a policy asks it to continue is a committed prefix
followed by the draft's own earlier proposals. The trace therefore holds, for each committed
prefix, the draft's greedy chain from it (tokens and probabilities, `depth` long), and a
replayed draft answers any path from the chain it lies on, at the measured cost per eval.

A synthetic acceptance rate (`SyntheticChains`) replaces the chains for sweeps: the draft's token
at each position equals the target's with that probability (a fixed seed: deterministic).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..decode.drafters import Proposal
from ..errors import UsageError
from .json_file import read_json, write_atomic

FORMAT = "pipeinfer-trace"
VERSION = 1


class TraceError(UsageError):
    """A trace that cannot be used: missing, unreadable, or for another model."""


@dataclass
class PromptTrace:
    prompt_id: str
    prompt: list[int]
    tokens: list[int]  # the target's generated tokens (any mode gives these)
    finish_reason: str  # "stop": the last token ends generation; "length"
    chains_from: int = 0  # chains[i] continues the first chains_from + i tokens of prompt + tokens
    chains: list[list[int]] = field(default_factory=list)
    chain_probs: list[list[float]] = field(default_factory=list)

    @property
    def full(self) -> list[int]:
        return self.prompt + self.tokens

    def token_after(self, pos: int) -> int:
        """The target's token after position pos (what the last stage samples for a row at pos)."""
        full = self.full
        return full[pos + 1] if pos + 1 < len(full) else full[-1]

    def is_eog(self, token: int) -> bool:
        return self.finish_reason == "stop" and bool(self.tokens) and token == self.tokens[-1]


@dataclass
class Trace:
    model: dict  # {"name", "file_bytes", "sha256"}
    draft: dict | None  # {"name", "kind", "sha256" (a model's)}
    sampling: dict  # {"temp", "seed"}: the sampling the tokens were generated with
    depth: int  # chain length recorded from each committed prefix
    prompts: list[PromptTrace]
    machine: dict | None = None  # where it was recorded: host, cpu, cores, usable_cpus, threads
    format: str = FORMAT
    version: int = VERSION

    def save(self, path: Path) -> None:
        write_atomic(Path(path), json.dumps(asdict(self)) + "\n")

    @staticmethod
    def load(path: Path | str) -> Trace:
        path = Path(path)
        d = read_json(path, TraceError, "trace", f"record one with `pipeinfer plan MODEL --record {path}`")
        if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("version") != VERSION:
            raise TraceError(f"{path} is not a pipeinfer trace (version {VERSION}); record one with "
                             f"`pipeinfer plan MODEL --record {path}`")
        try:
            prompts = [PromptTrace(**p) for p in d["prompts"]]
            return Trace(d["model"], d.get("draft"), d["sampling"], d["depth"], prompts, d.get("machine"))
        except (KeyError, TypeError) as e:
            raise TraceError(f"{path} is incomplete or malformed ({e}); record it again") from None


class ChainIndex:
    """Finds the continuation of any path the draft may be asked about."""

    def __init__(self, pt: PromptTrace):
        self.pt, self.full = pt, pt.full
        self.misses = 0  # paths on no recorded chain (past the recorded depth, or a tree's side branch)

    def chain(self, n: int) -> tuple[list[int], list[float]] | None:
        i = n - self.pt.chains_from
        if 0 <= i < len(self.pt.chains):
            return self.pt.chains[i], self.pt.chain_probs[i]
        return None

    def continuation(self, path: list[int]) -> tuple[list[int], list[float]]:
        """The draft's greedy tokens (and probabilities) after `path`, as recorded; ([], []) if none."""
        full, m = self.full, 0
        limit = min(len(path), len(full))
        while m < limit and path[m] == full[m]:
            m += 1
        for n in range(m, self.pt.chains_from - 1, -1):
            found = self.chain(n)
            if found is None:
                continue
            toks, probs = found
            j = len(path) - n
            if j <= len(toks) and path[n:] == toks[:j]:
                if j < len(toks):
                    return toks[j:], probs[j:]
                break
        if m < len(path) and m < self.pt.chains_from:  # a path cut short (a probe's context): by its end
            return self._by_suffix(path)
        self.misses += 1
        return [], []

    def _by_suffix(self, path: list[int]) -> tuple[list[int], list[float]]:
        for i in range(len(self.pt.chains) - 1, -1, -1):
            n = self.pt.chains_from + i
            for j in range(len(self.pt.chains[i]) + 1):
                cand = self.full[:n] + self.pt.chains[i][:j]
                if len(cand) >= len(path) and cand[len(cand) - len(path):] == path:
                    return self.pt.chains[i][j:], self.pt.chain_probs[i][j:]
        self.misses += 1
        return [], []


@dataclass
class Confidences:
    """The probabilities a draft gave its tokens, measured: those of tokens the target then took
    (right) and of tokens it did not (wrong). A synthetic draft reports one of these, drawn per
    position, instead of a constant, so that p_accept thresholds meet the draft's real spread."""

    right: list[float]
    wrong: list[float]

    def draw(self, rng: random.Random, is_right: bool, rate: float) -> float:
        pool = self.right if is_right else self.wrong
        return rng.choice(pool) if pool else rate


class SyntheticChains(ChainIndex):
    """Chains where each drafted token equals the target's with probability `rate`; the draft's
    confidence is drawn from measured `confidences` when given, else it is `rate` (so p_accept
    thresholds see a plausible number)."""

    def __init__(self, pt: PromptTrace, rate: float, depth: int, seed: int = 0, confidences: Confidences | None = None):
        super().__init__(pt)
        self.rate, self.depth, self.seed, self.confidences = rate, depth, seed, confidences
        self.right: dict[int, bool] = {}
        self.conf: dict[int, float] = {}

    def _rng(self, pos: int, what: int) -> random.Random:
        """The draws for one position, whatever order positions are asked in (a draft rank drafting
        ahead asks for later positions first than the head would)."""
        return random.Random((self.seed * 1_000_003 + pos) * 2 + what)

    def _is_right(self, pos: int) -> bool:
        if pos not in self.right:
            self.right[pos] = self._rng(pos, 0).random() < self.rate
        return self.right[pos]

    def _conf(self, pos: int) -> float:
        if self.confidences is None:
            return self.rate
        if pos not in self.conf:
            self.conf[pos] = self.confidences.draw(self._rng(pos, 1), self._is_right(pos), self.rate)
        return self.conf[pos]

    def continuation(self, path: list[int]) -> tuple[list[int], list[float]]:
        full, m = self.full, 0
        limit = min(len(path), len(full))
        while m < limit and path[m] == full[m]:
            m += 1
        if m < len(path):  # off the target's path: the draft keeps guessing wrong
            wrong = self.rate if self.confidences is None else min(self.confidences.wrong or [self.rate])
            return [-1] * self.depth, [wrong] * self.depth
        span = range(m, m + self.depth)
        toks = [full[p] if p < len(full) and self._is_right(p) else -1 for p in span]
        return toks, [self._conf(p) for p in span]


def greedy_walk(index: ChainIndex, path: list[int], n_max: int, p_min: float) -> tuple[Proposal, int]:
    """What `LlamaDrafter.propose(path, n_max, p_min)` returns, from the recorded chain, and the evals
    its loop makes after reading the path (one per token it goes on from; see drafters.py)."""
    out = Proposal([], [], [])
    if n_max <= 0:
        return out, 0
    toks, probs = index.continuation(path)
    evals = 0
    for tok, conf in zip(toks, probs):
        if conf < p_min and out.tokens:
            return out, evals  # stopped before taking it: the eval that gave it was made
        out.tokens.append(tok)
        out.probs.append(conf)
        out.alternatives.append([])
        if len(out.tokens) >= n_max or conf < p_min:
            return out, evals
        evals += 1
    return out, evals
