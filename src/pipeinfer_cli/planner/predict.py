"""One prediction: a request of a trace, in one mode, on one topology, in virtual time.

The head's request is run by the runner `generate` uses (`decode/request.py`: prefill, the mode's
decode loop) against a `SimulatedPipeline` built from the profile, with the replayed target and
draft. The metrics are the session's own (`GenerationMetrics.rates`), so a
prediction and a run compare field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..decode.draft_economy import DraftMemory
from ..decode.draft_spec import LOOKUP
from ..decode.modes import needs_draft
from ..decode.request import DraftSite, run_request
from ..decode.sampling import SamplingParams
from ..decode.session import DecodeOptions
from ..decode.slot_geometry import sequences_per_request
from .costs import StageCost
from .profile import DraftCosts, Profile, RankCosts
from .replay import ChainIndex, PromptTrace, SyntheticChains
from .sim_drafters import ReplayDrafter, ReplayDraftRank, TimedLookup
from .sim_pipeline import SimulatedPipeline


@dataclass
class Topology:
    """Stages in pipeline order: the profile rank whose costs each stage has, and its layers; the
    draft: "head", "lookup", a profile rank (an int: a draft rank of its own), or None."""

    stage_ranks: list[int]
    layers: list[tuple[int, int]]
    draft: str | int | None = None

    def describe(self) -> str:
        return ",".join(str(e - b) for b, e in self.layers) + ("/1" if isinstance(self.draft, int) else "")


@dataclass
class Prediction:
    mode: str
    prompt_id: str
    n_prompt: int
    n_gen: int
    ttft_s: float | None
    tok_per_s: float | None
    decode_tok_per_s: float | None
    itl_ms: dict | None
    acceptance: dict
    runs: dict
    utilisation: list[float]  # per stage, share of the request's time spent computing
    draft_misses: int = 0  # draft questions the trace could not answer (past its depth, tree side branches)
    draft_evals: int = 0  # tokens a draft model evaluated (what drafting cost: rejected drafts included)
    settings: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {k: v for k, v in vars(self).items()}


def _stages(profile: Profile, topo: Topology) -> list[StageCost]:
    last = len(topo.layers) - 1
    return [StageCost(profile.ranks[r], e - b, has_output=i == last)
            for i, (r, (b, e)) in enumerate(zip(topo.stage_ranks, topo.layers))]


def build_pipeline(profile: Profile, topo: Topology, pt: PromptTrace, opts: DecodeOptions, n_ctx: int) -> SimulatedPipeline:
    ranks = topo.stage_ranks
    links = [profile.link(ranks[i], ranks[i + 1]) for i in range(len(ranks) - 1)] + [profile.link(ranks[-1], ranks[0])]
    cancel_links = [profile.link(ranks[0], r) for r in ranks]
    d = profile.draft  # a draft model computes on the head's host, or on its own rank's
    draft_threads = d.threads if d is not None and d.is_model and topo.draft not in (None, LOOKUP) else None
    draft_rank = profile.ranks[topo.draft] if isinstance(topo.draft, int) else None
    return SimulatedPipeline(_stages(profile, topo), links, cancel_links, profile.model.n_embd,
                             lambda _context, pos: pt.token_after(pos),
                             sequences_per_request(opts.max_inflight, opts.max_branches), n_ctx, draft_rank,
                             draft_threads)


def make_drafter(profile: Profile, topo: Topology, pipe: SimulatedPipeline, index: ChainIndex | None):
    d = profile.draft
    if topo.draft is None:
        return None
    if topo.draft == LOOKUP:
        costs = d if d is not None and d.is_lookup else DraftCosts("lookup", "lookup", 0, 1, 2e-5, 0.0)
        if isinstance(index, SyntheticChains):  # an acceptance rate given for lookup: a draft of that rate, at its cost
            return ReplayDrafter(pipe, index, costs)
        return TimedLookup(pipe, costs)
    if d is None or not d.is_model:
        raise ValueError("the profile has no draft model's costs: calibrate with --draft MODEL")
    if index is None:
        raise ValueError("a draft model needs a trace with its chains (or a synthetic acceptance rate)")
    if topo.draft == "head":
        return ReplayDrafter(pipe, index, d)
    r = int(topo.draft)
    return ReplayDraftRank(pipe, index, d, profile.link(topo.stage_ranks[0], r), profile.link(r, topo.stage_ranks[0]))


def predict(profile: Profile, topo: Topology, mode: str, pt: PromptTrace, opts: DecodeOptions,
            index: ChainIndex | None = None, n_ctx: int = 4096) -> Prediction:
    """Run the request of `pt` in `mode` on `topo`, in virtual time."""
    pipe = build_pipeline(profile, topo, pt, opts, n_ctx)
    drafter = make_drafter(profile, topo, pipe, index) if needs_draft(mode) else None
    opts = replace(opts, n_predict=len(pt.tokens))
    # Only a draft model on the head has a prompt pass that competes with the target for its
    # cores (prompt lookup, even replayed at a synthetic rate, has none); in virtual time the pass
    # is charged to the clock, not run in a thread.
    site = DraftSite(on_head=topo.draft == "head", threaded=False)
    s = run_request(pipe, mode, list(pt.prompt), opts, drafter, sampling=SamplingParams(), n_predict=len(pt.tokens),
                    is_eog=pt.is_eog, site=site, memory=DraftMemory(), clock=pipe.clock)
    if s.generated != pt.tokens[:len(s.generated)]:
        raise AssertionError(f"{mode} replayed tokens other than the trace's: the simulation lost a token")
    rates = s.metrics.rates()
    return Prediction(mode, pt.prompt_id, rates.n_prompt, rates.n_gen, rates.ttft_s, rates.tok_per_s,
                      rates.decode_tok_per_s, rates.itl_ms, s.metrics.acceptance.to_dict(), vars(s.metrics.runs).copy(),
                      pipe.utilisation(), index.misses if index is not None else 0,
                      drafter.model.evals if isinstance(drafter, (ReplayDrafter, ReplayDraftRank)) else 0,
                      {"layer_split": topo.describe(), "draft": topo.draft, "n_draft": opts.n_draft,
                       "p_accept": opts.p_accept, "max_inflight": opts.max_inflight, "max_branches": opts.max_branches})


def synthetic_rank(base: RankCosts, speed: float = 1.0, rank: int = 0, host: str = "") -> RankCosts:
    """A node described by its speed relative to a measured one (2.0: twice as fast), every cost scaled."""
    scale = lambda g: replace(g, s=[[v / speed for v in row] for row in g.s])  # noqa: E731
    return replace(base, rank=rank, host=host or f"node{rank}", decode=scale(base.decode), prefill=scale(base.prefill),
                   output_row_s=base.output_row_s / speed, run_overhead_s=base.run_overhead_s / speed)
