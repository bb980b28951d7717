"""Plans: predictions for every mode over a set of prompts, summarised as `pipeinfer bench`
summarises runs (medians over prompts, speedup as the geometric mean of per-prompt ratios); the
search of the settings over them is planner/search.py.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from ..decode.session import DecodeOptions
from .predict import Prediction, Topology, predict
from .profile import Profile
from .replay import ChainIndex, Confidences, PromptTrace, SyntheticChains

class Replay:
    """The prompts of a trace, each with a fresh chain index per prediction (misses are counted per run).
    acceptance: a synthetic draft right with this probability; confidences: the draft's measured
    probabilities (Confidences) it reports, else the rate itself."""

    def __init__(self, prompts: list[PromptTrace], acceptance: float | None = None, depth: int = 24,
                 confidences: Confidences | None = None):
        self.prompts, self.acceptance, self.depth, self.confidences = prompts, acceptance, depth, confidences

    def index(self, pt: PromptTrace) -> ChainIndex:
        if self.acceptance is not None:
            return SyntheticChains(pt, self.acceptance, self.depth, confidences=self.confidences)
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
    note: str | None = None  # why a drafting mode's figures equal iterative's (planner/search.never_speculated)

    def as_dict(self) -> dict:
        d = {k: v for k, v in vars(self).items() if k not in ("speedup", "predictions", "best", "note")}
        for k in ("speedup", "predictions"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        d["note"] = self.note
        if self.best is not None:
            d["best"] = self.best
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
    """Each prompt's prediction, each with a fresh chain index (Replay.index) made before it runs."""
    indexed = [(pt, replay.index(pt)) for pt in replay.prompts]
    return [predict(profile, topo, mode, pt, opts, index, n_ctx) for pt, index in indexed]


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
