"""The search for the fastest mode and settings: one grid and one answer, for `plan --search` and
for `-M auto` (planner/auto_choice.py), so that the same profile, draft and acceptance give the same
choice in both.

Every candidate runs the real policies in virtual time (planner/predict.py) over the prompts of a
`Replay`; the fastest predicted median tok/s wins, and a tie goes to the simpler mode (iterative,
then speculative, then pipeinfer) and the first settings of the grid. A drafting mode whose draft
never proposed a token ran exactly as iterative does: it is never chosen over iterative, and
`never_speculated` says why its figures equal iterative's.

**Placement.** Where the job's work goes (which ranks hold which layers, where the draft runs, the
threads of each rank: planner/placement.py) is searched with the settings when the caller gives
candidates (`choose(..., placements_of=...)`): every candidate of a mode is simulated on a coarse
grid of its settings (COARSE_*), the fastest candidate then on the whole grid. A tie goes to the
first candidate (the draft on the head, the balanced head, the job's own threads first).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..decode.modes import needs_draft
from ..decode.draft_spec import LOOKUP
from ..decode.session import DecodeOptions
from .plan import Replay, run_mode, summarize
from .predict import Prediction, Topology
from .profile import Profile
from .replay import PromptTrace

if TYPE_CHECKING:
    from .placement import Placement
    from .split import HeadLoad

# The settings searched (pipeinfer's knobs; speculative uses n_draft alone).
N_DRAFT = (1, 2, 3, 4, 6, 8)
P_ACCEPT = (0.0, 0.3, 0.5, 0.7, 0.9)
MAX_INFLIGHT = (2, 4, 6, 8)  # those up to twice the stages (at least 2 and 4): more runs than that only queue

# The coarse grid each placement candidate is compared on (the winner is searched on the whole grid).
COARSE_N_DRAFT = (1, 3)
COARSE_P_ACCEPT = (0.0, 0.5)

# The request -M auto plans for when it has no prompt of its own (chat, serve): prompt and reply tokens.
AUTO_PROMPT = 128
AUTO_GEN = 96


@dataclass
class ModeBest:
    mode: str
    opts: DecodeOptions
    tok_per_s: float | None
    summary: dict  # planner.plan.summarize of the best settings
    note: str | None = None  # why its figures equal another mode's (never_speculated)
    placement: Placement | None = None  # where its work goes, when placements were searched
    others: list[tuple[Placement, float | None]] = field(default_factory=list)  # the candidates it beat


@dataclass
class Choice:
    """The fastest mode and its settings, and the best settings of every mode searched."""

    mode: str
    opts: DecodeOptions
    tok_per_s: float | None
    per_mode: dict[str, ModeBest] = field(default_factory=dict)

    @property
    def placement(self) -> Placement | None:
        return self.per_mode[self.mode].placement


def candidate_options(mode: str, opts: DecodeOptions, n_stages: int = 2,
                      max_inflight_cap: int | None = None, coarse: bool = False) -> list[DecodeOptions]:
    """max_inflight_cap: the most runs in flight a job already started can hold (its KV sequences
    were opened for its first settings); None: any the grid has. coarse: the coarse grid."""
    n_drafts, p_accepts = (COARSE_N_DRAFT, COARSE_P_ACCEPT) if coarse else (N_DRAFT, P_ACCEPT)
    if mode == "iterative" or not needs_draft(mode):
        return [opts]
    if mode == "speculative":
        return [replace(opts, n_draft=k) for k in n_drafts]
    inflight = [f for f in MAX_INFLIGHT if f <= max(4, 2 * n_stages)
                and (max_inflight_cap is None or f <= max_inflight_cap)] or [max_inflight_cap]
    if coarse:
        inflight = inflight[-1:]
    return [replace(opts, n_draft=k, p_accept=p, max_inflight=f)
            for k, p, f in itertools.product(n_drafts, p_accepts, inflight)]


def search_settings(profile: Profile, topo: Topology, mode: str, replay: Replay, opts: DecodeOptions, n_ctx: int,
                    on_step: Callable[[int, int], None] | None = None,
                    max_inflight_cap: int | None = None, coarse: bool = False) -> ModeBest:
    """The options among `candidate_options` with the highest predicted median tok/s."""
    best = None
    cands = candidate_options(mode, opts, len(topo.stage_ranks), max_inflight_cap, coarse)
    for i, cand in enumerate(cands, start=1):
        s = summarize(run_mode(profile, topo, mode, replay, cand, n_ctx))
        speed = s.tok_per_s
        if best is None or (speed is not None and (best.tok_per_s is None or speed > best.tok_per_s)):
            best = ModeBest(mode, cand, speed, s)
        if on_step is not None:
            on_step(i, len(cands))
    best.note = never_speculated(mode, best.summary, topo.draft)
    return best


def search_placed(cands: list[Placement], mode: str, replay: Replay, opts: DecodeOptions, n_ctx: int,
                  on_step: Callable[[int, int], None] | None = None) -> ModeBest:
    """The fastest placement of `cands` for `mode` (each on the coarse grid), searched on the
    whole grid; the others with their coarse figures in `others`."""
    scored = []
    for p in cands:
        b = search_settings(p.profile, p.topo, mode, replay, opts, n_ctx, coarse=True) if len(cands) > 1 else None
        scored.append((p, None if b is None else b.tok_per_s))
    win, win_speed = scored[0]
    for p, speed in scored[1:]:
        if speed is not None and (win_speed is None or speed > win_speed):
            win, win_speed = p, speed
    best = search_settings(win.profile, win.topo, mode, replay, opts, n_ctx, on_step)
    best.placement, best.others = win, [(p, s) for p, s in scored if p is not win]
    return best


def head_load(preds: list[Prediction]) -> HeadLoad:
    """The head's own work per generated token in these predictions (split.HeadLoad): the tokens
    its draft model evaluated, and its speculative results taken (speculative runs launched less
    runs cancelled: a lower bound where plain runs were cancelled too)."""
    from .split import HeadLoad

    n = sum(p.n_gen for p in preds) or 1
    commits = sum(max(0, p.runs.get("speculative", 0) - p.runs.get("cancelled", 0)) for p in preds)
    return HeadLoad(sum(p.draft_evals for p in preds) / n, commits / n)


def choose(profile: Profile, topo_of: Callable[[str], Topology], modes: list[str], replay: Replay,
           opts: DecodeOptions, n_ctx: int, on_step: Callable[[str, int, int], None] | None = None,
           placements_of: Callable[[str], list[Placement]] | None = None) -> Choice:
    """The fastest mode of `modes` (in the order given, simplest first) with its best settings.
    placements_of(mode): the candidates where the mode's work may go (planner/placement.py);
    None: topo_of(mode) on the profile as it is."""
    per_mode = {}
    for m in modes:
        step = None if on_step is None else (lambda i, n, m=m: on_step(m, i, n))
        if placements_of is not None:
            per_mode[m] = search_placed(placements_of(m), m, replay, opts, n_ctx, step)
        else:
            per_mode[m] = search_settings(profile, topo_of(m), m, replay, opts, n_ctx, step)
    best = None
    for m, b in per_mode.items():
        if b.note is not None and "iterative" in per_mode:
            continue  # it ran as iterative does, with the draft's cost on top
        if b.tok_per_s is not None and (best is None or b.tok_per_s > best.tok_per_s):
            best = b
    best = best or next(iter(per_mode.values()))
    return Choice(best.mode, best.opts, best.tok_per_s, per_mode)


def never_speculated(mode: str, summary, draft) -> str | None:
    """Why a drafting mode's figures equal iterative's: its draft never proposed a token."""
    if not needs_draft(mode) or summary.acceptance["drafted"]:
        return None
    if draft == LOOKUP:
        return ("never speculated: prompt lookup found no earlier occurrence of the text's last tokens to propose "
                "from, so every step ran as iterative does (--acceptance RATE assumes a rate instead)")
    return "never speculated: the draft proposed no token, so every step ran as iterative does"


def auto_request(prompt: list[int] | None = None, n_gen: int = AUTO_GEN) -> PromptTrace:
    """The request -M auto plans for: the job's prompt (else AUTO_PROMPT tokens) and n_gen generated
    tokens (ids that never repeat: the replay's acceptance alone decides what a draft gets right)."""
    prompt = list(prompt) if prompt else list(range(1000, 1000 + AUTO_PROMPT))
    return PromptTrace("auto", prompt, [1_000_000 + i for i in range(n_gen)], "length")
