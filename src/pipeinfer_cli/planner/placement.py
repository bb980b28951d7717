"""Where a job's work goes, as candidates for the search to simulate: which ranks hold which target
layers, where the draft model runs, and how many threads each rank computes with.

For a job of N ranks and a mode that drafts with a model, the candidates are every placement the
`--layer-split` grammar can say:

- the draft in the head's process, N target stages, the layers balanced by measured time with the
  head's own work counted (`split.HeadLoad`: the draft's evals by the tokens it drafts, its
  bookkeeping per speculative result, both as the simulation of the mode counts them);
- the same with a lighter head: it holds 3/4 or 1/2 of the layers that balance gives it
  (at least one), the others balanced over the other stages;
- the draft on a rank of its own (`…/1`): the last rank, on its host, drafts; N - 1 target stages.

A head with no target layers is not a placement the grammar can say (every fraction is positive
and rank 0 is the first stage), so it is not a candidate. Modes that do not draft with a model get
the one split with nothing besides its layers on the head.

**Threads.** A candidate also says each rank's threads. Calibration measured each rank at one
thread count; a rank run at another takes its costs from a profile measured at that count where
the caller has one (`measured`), else they are extrapolated: its layer, prompt and output
seconds scale by (min(t, u) / min(t', u)) ** THREAD_SCALING from the measured t' threads to t, u
its host's usable CPUs (linear speed-up up to the CPUs it may use, tempered by THREAD_SCALING for
the memory bandwidth threads share; no gain beyond the usable CPUs). The fixed cost per run
(Python, one thread) does not scale. A draft model moved to another rank, or run with other
threads, scales the same way: by the ratio of the two ranks' measured one-row layer seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..decode.draft_spec import LOOKUP
from .costs import grid_seconds
from .predict import Topology
from .profile import CostGrid, Profile, RankCosts
from .split import HeadLoad, JobMemory, auto_split

# The exponent of the speed-up from more threads when no profile measured them (module doc).
THREAD_SCALING = 0.8
LIGHTER_HEAD = (0.75, 0.5)  # shares of the balanced head's layers tried for a lighter head


@dataclass
class Placement:
    """One candidate: the topology the simulation runs, the profile of its ranks at its threads
    (the draft's costs where it runs), each rank's threads, and how it was derived."""

    topo: Topology
    profile: Profile
    threads: list[int]  # per rank of the job (a draft rank included)
    what: str  # "draft on the head", "draft on rank 3", "lighter head (5 of 7 layers)", ...
    extrapolated: list[int] | None = None  # ranks whose costs are extrapolated to their threads
    idle_draft_rank: bool = False  # the user's split has a draft rank (auto/1) that this mode leaves idle

    def layer_split(self) -> str:
        """The --layer-split that runs it: layer counts per stage (exact), "/1" for a draft rank."""
        return self.topo.describe() + ("/1" if self.idle_draft_rank else "")

    def threads_option(self) -> str:
        t = self.threads
        return str(t[0]) if len(set(t)) == 1 else ",".join(map(str, t))


def scale_rank(rc: RankCosts, threads: int) -> RankCosts:
    """rc's costs at `threads` threads, extrapolated (the module doc)."""
    if threads == rc.threads:
        return rc
    f = thread_speedup(rc, rc.threads, threads)
    grid = lambda g: CostGrid(g.rows, g.kv, [[v / f for v in row] for row in g.s])  # noqa: E731
    return replace(rc, threads=threads, decode=grid(rc.decode), prefill=grid(rc.prefill),
                   output_row_s=rc.output_row_s / f)


def thread_speedup(rc: RankCosts, measured: int, threads: int) -> float:
    usable = rc.usable_cpus if rc.usable_cpus is not None else rc.cores
    return (min(threads, usable) / min(measured, usable)) ** THREAD_SCALING


def at_threads(profile: Profile, threads: list[int], measured: dict[int, Profile] | None = None
               ) -> tuple[Profile, list[int]]:
    """The profile with rank r at threads[r] (ranks beyond threads as measured): from `measured`
    (a profile of the same ranks at that thread count) where there is one, else extrapolated.
    Returns the profile and the ranks extrapolated."""
    ranks, guessed = [], []
    for rc in profile.ranks:
        t = threads[rc.rank] if rc.rank < len(threads) else rc.threads
        other = (measured or {}).get(t)
        if t != rc.threads and other is not None and rc.rank < len(other.ranks) and other.ranks[rc.rank].threads == t:
            ranks.append(other.ranks[rc.rank])
        else:
            ranks.append(scale_rank(rc, t))
            if t != rc.threads:
                guessed.append(rc.rank)
    return replace(profile, ranks=ranks), guessed


def draft_on(profile: Profile, base: Profile, rank: int) -> Profile:
    """`profile` with its draft model's costs on profile rank `rank`, at that rank's threads: the
    draft's measured costs (base: the profile as calibrated) times the ratio of the two ranks'
    one-row layer seconds (as scaled to their threads)."""
    d = profile.draft
    if d is None or not d.is_model:
        return profile
    was = base.ranks[d.rank]
    now = profile.ranks[rank]
    ratio = _one_row(now) / _one_row(was)
    return replace(profile, draft=replace(d, rank=rank, threads=now.threads, token_s=d.token_s * ratio,
                                          prompt_token_s=d.prompt_token_s * ratio))


def _one_row(rc: RankCosts) -> float:
    return grid_seconds(rc.decode, 1, rc.decode.kv[0])


def placements(profile: Profile, n_ranks: int, threads: list[int], draft: str | None, mem: JobMemory,
               head: HeadLoad, fixed: str | None = None, measured: dict[int, Profile] | None = None,
               parallel: int = 1, load_policy: str = "yield") -> list[Placement]:
    """The candidates for a job of n_ranks ranks at `threads` (module doc). draft: "model" (a draft
    model the mode drafts with), "lookup", or None (the mode does not draft). fixed: "head" or
    "rank" when the user's --layer-split chose where the draft runs (auto, auto/1), None: both.
    mem: the job's memory besides the weights (its draft_rank is ignored: each candidate sets it).
    Candidates that cannot fit in memory are left out; none fitting raises the split's UsageError."""
    from ..errors import UsageError

    prof, guessed = at_threads(profile, threads, measured)
    out: list[Placement] = []
    errors: list[UsageError] = []
    stages = list(range(n_ranks))
    where = LOOKUP if draft == LOOKUP else None
    if draft == "model":
        on_head = draft_on(prof, profile, 0)
        head_mem = replace(mem, draft_rank=None)
        if fixed != "rank":
            try:
                base = auto_split(on_head, stages, True, head_mem, parallel, load_policy, head)
                out.append(Placement(Topology(stages, base, "head"), on_head, threads, "draft on the head", guessed))
                k = base[0][1]
                for share in LIGHTER_HEAD:
                    h = max(1, math.ceil(k * share))
                    if h >= k or any(p.topo.layers[0][1] == h for p in out) or n_ranks < 2:
                        continue
                    try:
                        split = auto_split(on_head, stages, True, head_mem, parallel, load_policy, head, head_layers=h)
                    except UsageError:
                        continue
                    out.append(Placement(Topology(stages, split, "head"), on_head, threads,
                                         f"draft on the head, a lighter head ({h} of {k} layers)", guessed))
            except UsageError as e:
                errors.append(e)
        if fixed != "head" and n_ranks >= 2:
            r = n_ranks - 1
            on_rank = draft_on(prof, profile, r)
            try:
                split = auto_split(on_rank, stages[:-1], False, replace(mem, draft_rank=r), parallel, load_policy,
                                   HeadLoad(0.0, head.commits))
                out.append(Placement(Topology(stages[:-1], split, r), on_rank, threads,
                                     f"draft on rank {r} of its own", guessed))
            except UsageError as e:
                errors.append(e)
    else:
        idle = fixed == "rank" and n_ranks >= 2  # the user's auto/1: the last rank stays the draft rank
        stages = stages[:-1] if idle else stages
        split = auto_split(prof, stages, False, replace(mem, draft_rank=None, draft_bytes=0), parallel, load_policy,
                           HeadLoad(0.0, head.commits if draft else 0.0))
        out.append(Placement(Topology(stages, split, where), prof, threads,
                             "prompt lookup on the head" if draft else "no draft", guessed, idle))
    if not out and errors:
        raise errors[0]
    return out

