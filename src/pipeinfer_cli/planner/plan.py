"""Plans: predictions for every mode over a set of prompts, summarised as `pipeinfer bench`
summarises runs (medians over prompts, speedup as the geometric mean of per-prompt ratios), and a
search of the settings that the prediction says are fastest.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..decode.session import DecodeOptions
from .predict import Prediction, Topology, predict
from .profile import Profile
from .replay import ChainIndex, PromptTrace, SyntheticChains

# The settings `--search` tries (pipeinfer's knobs; speculative uses n_draft alone).
SEARCH_N_DRAFT = (1, 2, 3, 4, 6, 8)
SEARCH_P_ACCEPT = (0.0, 0.3, 0.5, 0.7, 0.9)
SEARCH_MAX_INFLIGHT = (2, 4, 6, 8)


class Replay:
    """The prompts of a trace, each with a fresh chain index per prediction (misses are counted per run)."""

    def __init__(self, prompts: list[PromptTrace], acceptance: float | None = None, depth: int = 24):
        self.prompts, self.acceptance, self.depth = prompts, acceptance, depth

    def index(self, pt: PromptTrace) -> ChainIndex:
        if self.acceptance is not None:
            return SyntheticChains(pt, self.acceptance, self.depth)
        return ChainIndex(pt)


def _median(vals: list[float]) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


@dataclass
class ModeSummary:
    """One mode's predicted figures over the prompts (medians; an entry of `plan --json`'s "modes")."""

    n_prompts: int
    n_gen: int
    tok_per_s: float | None
    decode_tok_per_s: float | None
    ttft_s: float | None
    itl_ms: dict[str, float | None]  # p50, p90
    acceptance: dict[str, float | None]  # drafted, accepted, rate
    utilisation: list[float | None]  # per stage: its share of the time computing
    draft_misses: int
    settings: dict  # the prediction's settings (layer split, draft, n_draft, ...), as predict.py writes them
    speedup: dict[str, float | None] | None = None  # vs_iterative, vs_speculative (plan_modes)
    predictions: list[dict] | None = None  # every prompt's prediction (plan_modes)
    best: dict | None = None  # plan --search: the best settings found and their tok/s

    def as_dict(self) -> dict:
        d = {k: v for k, v in vars(self).items() if k not in ("speedup", "predictions", "best")}
        for k in ("speedup", "predictions", "best"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d


def summarize(preds: list[Prediction]) -> ModeSummary:
    drafted = sum(p.acceptance["drafted"] for p in preds)
    accepted = sum(p.acceptance["accepted"] for p in preds)
    n_stages = max(len(p.utilisation) for p in preds)
    return ModeSummary(
        n_prompts=len(preds), n_gen=sum(p.n_gen for p in preds),
        tok_per_s=_median([p.tok_per_s for p in preds]), decode_tok_per_s=_median([p.decode_tok_per_s for p in preds]),
        ttft_s=_median([p.ttft_s for p in preds]),
        itl_ms={"p50": _median([p.itl_ms["p50"] for p in preds if p.itl_ms]),
                "p90": _median([p.itl_ms["p90"] for p in preds if p.itl_ms])},
        acceptance={"drafted": drafted, "accepted": accepted, "rate": accepted / drafted if drafted else None},
        utilisation=[_median([p.utilisation[i] for p in preds if i < len(p.utilisation)]) for i in range(n_stages)],
        draft_misses=sum(p.draft_misses for p in preds), settings=preds[0].settings,
    )


def speedup(a: list[Prediction], b: list[Prediction]) -> float | None:
    """Geometric mean over prompts of tok/s ratios (as the bench computes its speedups)."""
    ratios = [x.tok_per_s / y.tok_per_s for x, y in zip(a, b) if x.tok_per_s and y.tok_per_s]
    return math.exp(statistics.fmean(math.log(r) for r in ratios)) if ratios else None


def run_mode(profile: Profile, topo: Topology, mode: str, replay: Replay, opts: DecodeOptions,
             n_ctx: int) -> list[Prediction]:
    return [predict(profile, topo, mode, pt, opts, replay.index(pt), n_ctx) for pt in replay.prompts]


def plan_modes(profile: Profile, topo_of: Callable[[str], Topology], modes: list[str], replay: Replay,
               opts: DecodeOptions, n_ctx: int) -> dict[str, ModeSummary]:
    """{mode: summary with its predictions} and speedups against the baselines among `modes`."""
    runs = {m: run_mode(profile, topo_of(m), m, replay, opts, n_ctx) for m in modes}
    out = {}
    for m, preds in runs.items():
        s = summarize(preds)
        s.speedup = {f"vs_{b}": speedup(preds, runs[b]) for b in ("iterative", "speculative") if b in runs}
        s.predictions = [p.to_json() for p in preds]
        out[m] = s
    return out


def candidate_options(mode: str, opts: DecodeOptions) -> list[DecodeOptions]:
    if mode == "iterative":
        return [opts]
    if mode == "speculative":
        return [replace(opts, n_draft=k) for k in SEARCH_N_DRAFT]
    return [replace(opts, n_draft=k, p_accept=p, max_inflight=f)
            for k, p, f in itertools.product(SEARCH_N_DRAFT, SEARCH_P_ACCEPT, SEARCH_MAX_INFLIGHT)]


def search_settings(profile: Profile, topo: Topology, mode: str, replay: Replay, opts: DecodeOptions,
                    n_ctx: int, on_step: Callable[[int, int], None] | None = None) -> tuple[DecodeOptions, float | None]:
    """The options among `candidate_options` with the highest predicted median tok/s."""
    best, best_speed = opts, None
    cands = candidate_options(mode, opts)
    for i, cand in enumerate(cands, start=1):
        speed = summarize(run_mode(profile, topo, mode, replay, cand, n_ctx)).tok_per_s
        if speed is not None and (best_speed is None or speed > best_speed):
            best, best_speed = cand, speed
        if on_step is not None:
            on_step(i, len(cands))
    return best, best_speed
