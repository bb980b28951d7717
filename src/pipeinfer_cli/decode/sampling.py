"""Deterministic sampling: each committed token is a function of (logits, seed, position) only.

That makes every mode (iterative, speculative, pipeinfer) print the same text for the same seed,
whatever the batching or the order in which runs complete, so losslessness can be tested exactly.
The random number for position j comes from a counter-based generator (splitmix64 of seed and j),
not from a stateful RNG.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position)."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) >> 11) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 40  # 0 = whole vocabulary
    top_p: float = 0.95  # 1.0 = off
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (0 = off)
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def sample(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """Pick the token at sequence index `position` from its logits row (n_vocab,)."""
    if params.greedy:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    k = params.top_k if 0 < params.top_k < len(scaled) else len(scaled)
    # Top-k candidates sorted by logit (ties broken by token id, so the order is deterministic).
    cand = np.argpartition(-scaled, k - 1)[:k] if k < len(scaled) else np.arange(len(scaled))
    cand = cand[np.lexsort((cand, -scaled[cand]))]
    p = np.exp(scaled[cand] - scaled[cand[0]])
    p /= p.sum()
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), params.top_p) + 1)
        cand, p = cand[:keep], p[:keep] / p[:keep].sum()
    if params.min_p > 0.0:
        keep = int(np.count_nonzero(p >= params.min_p * p[0]))  # p is sorted, p[0] the largest
        cand, p = cand[:keep], p[:keep] / p[:keep].sum()
    u = uniform(params.seed, position)
    idx = int(np.searchsorted(np.cumsum(p), u, side="right"))
    return int(cand[min(idx, len(cand) - 1)])


def sample_rows(logits: np.ndarray, params: SamplingParams, positions) -> np.ndarray:
    """The token after each row of logits `(n_out, n_vocab)`, row i sampled for sequence index
    positions[i]. The last stage calls this, so that only token ids cross the network."""
    return np.asarray([sample(row, params, int(p)) for row, p in zip(logits, positions)], np.int64)


def to_spec(params: SamplingParams):
    from ..transport.messages import SamplingSpec

    return SamplingSpec(params.temperature, params.top_k, params.top_p, params.min_p, params.seed)


def from_spec(spec) -> SamplingParams:
    return SamplingParams(temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p, min_p=spec.min_p,
                          seed=spec.seed)


def softmax_top(logits: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The n most likely tokens and their probabilities (for draft confidence and tree splits)."""
    top = np.argpartition(-logits, n - 1)[:n] if n < len(logits) else np.arange(len(logits))
    top = top[np.argsort(-logits[top], kind="stable")]
    m = float(logits.max())
    z = float(np.exp(logits.astype(np.float64) - m).sum())
    return top, np.exp(logits[top].astype(np.float64) - m) / z
