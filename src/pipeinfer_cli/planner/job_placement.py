"""Where -M auto and --layer-split auto place a job: the candidates planner/placement.py builds for
it (where the draft runs, how many layers the head holds, the threads of each rank), from the
job's configuration and its profile, and the words that say what was chosen."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..decode.draft_spec import LOOKUP
from ..decode.modes import needs_draft
from .identity import default_threads
from .job_config import JobConfig
from .layout import parse_threads, plan_job

if TYPE_CHECKING:
    from ..decode.session import DecodeOptions


def split_is_chosen(cfg: JobConfig, n_ranks: int) -> bool:
    """Whether the planner places the job (--layer-split auto, auto/1, or none given with -M auto)
    rather than the user's own fractions. Not for several requests at once (serve --parallel N):
    their split is balanced for the aggregate (planner/split.py), not for one request's speed."""
    return n_ranks > 1 and cfg.parallel <= 1 and (not cfg.layer_split or cfg.layer_split.startswith("auto"))


def draft_kind(cfg: JobConfig, mode: str) -> str | None:
    """What the mode drafts with: "model" (a draft model, hybrid included), "lookup", or None."""
    if not needs_draft(mode) or not cfg.draft:
        return None
    return "model" if cfg.draft.uses_model else "lookup"


def job_placements(cfg: JobConfig, prof, n_ranks: int, mode: str, replay, measured: dict | None = None,
                   threads: list[list[int]] | None = None) -> list:
    """The placements the search compares for `mode` (planner/placement.py): every thread count the
    job could run with (thread_options) times, where the planner places the job, every placement;
    else the job's own split. The head's own work is measured by simulating the mode at the job's
    settings on the first candidate, then the candidates are split again with it."""
    from .placement import Placement, at_threads, draft_on, placements
    from .plan import run_mode
    from .search import head_load
    from .split import HeadLoad

    kind = draft_kind(cfg, mode)
    out: list[Placement] = []
    for t in threads or thread_options(prof, cfg, n_ranks, mode):
        if not split_is_chosen(cfg, n_ranks):
            topo = job_topology(cfg.model_path, cfg.model_label, n_ranks, cfg.layer_split, cfg.draft_path, cfg.draft,
                                needs_draft(mode), mode, cfg.profile, cfg.n_ctx)
            p, guessed = at_threads(prof, t, measured)
            if isinstance(topo.draft, int) or topo.draft == "head":
                p = draft_on(p, prof, topo.draft if isinstance(topo.draft, int) else 0)
            out.append(Placement(topo, p, t, "the job's --layer-split", guessed))
            continue
        # auto/1: the user put the draft on a rank of its own; auto (or no split): the planner places it.
        fixed = "rank" if cfg.layer_split and "/" in cfg.layer_split else None
        mem = _job_memory(cfg, n_ranks, kind == "model")
        first = placements(prof, n_ranks, t, kind, mem, HeadLoad(), fixed, measured)
        load = HeadLoad()
        if kind is not None:
            preds = run_mode(first[0].profile, first[0].topo, mode, replay, cfg.decode, cfg.n_ctx)
            load = head_load(preds)
        out += placements(prof, n_ranks, t, kind, mem, load, fixed, measured)
    return out


def _job_memory(cfg: JobConfig, n_ranks: int, with_draft: bool):
    from ..models.gguf_info import read_model_info
    from .split import profile_for_split

    _, mem = profile_for_split(cfg.profile, cfg.model_path, cfg.model_label, read_model_info(cfg.model_path),
                               cfg.n_ctx, cfg.draft_path if with_draft else None, n_ranks, False)
    return mem


def thread_options(prof, cfg: JobConfig, n_ranks: int, mode: str) -> list[list[int]]:
    """The threads per rank the job could run with: --threads as given; else the profile's and
    `generate`'s default for the mode on the profile's hosts (job_threads: all of a
    host's CPUs for iterative on one machine, a share of them for the drafting modes), without those
    the planner cannot model for a mode whose ranks compute at once (several threads per rank on
    too few CPUs: planner/shared_cores.unmodelled)."""
    from .shared_cores import unmodelled, usable_cpus

    if cfg.threads is not None:
        return [parse_threads(cfg.threads, n_ranks, 1)]
    opts = []
    for t in ([rc.threads for rc in prof.ranks[:n_ranks]], job_threads(prof, mode, None, n_ranks)):
        if t in opts:
            continue
        if needs_draft(mode) and opts and unmodelled([(r, prof.ranks[r].host, t[r], usable_cpus(prof.ranks[r]))
                                                       for r in range(n_ranks)]):
            continue
        opts.append(t)
    return opts


def placement_search(setup, prof, opts: DecodeOptions, threads: str | None, replay):
    """For `plan --search --layer-split auto` (setup: plan's _Setup): the placements -M auto
    searches for each mode, as job_placements gives them for the job `plan` describes; None
    where plan has the user's own split (each mode is then planned on it, at the profile's threads)."""
    if not (setup.layer_split or "").startswith("auto") or setup.n_ranks < 2:
        return None
    cfg = JobConfig(model_path=setup.path, model_label=setup.label, draft_path=setup.draft_path, draft=setup.draft,
                    decode=opts, n_ctx=setup.n_ctx, layer_split=setup.layer_split, threads=threads,
                    profile=setup.profile_path)
    return lambda mode: job_placements(cfg, prof, setup.n_ranks, mode, replay)


def placement_note(best) -> str:
    """How the chosen placement compares with the others the search simulated (coarse figures)."""
    p = best.placement
    if p is None:
        return ""
    others = [f"{q.what} {q.layer_split()}: {s:.2f}" for q, s in best.others if s is not None and q.threads == p.threads]
    return p.what + (f"; against {'; '.join(others)} tok/s on the coarse grid" if others else "")


def threads_note(prof, p, measured: dict | None) -> str:
    """Where the chosen threads' costs came from: the profile's, a profile at those threads, or extrapolated."""
    from .placement import THREAD_SCALING

    base = [rc.threads for rc in prof.ranks[:len(p.threads)]]
    if p.threads == base:
        return f"the profile's --threads {p.threads_option()}"
    if not p.extrapolated:
        return f"--threads {p.threads_option()} (measured by a calibration at those threads)"
    return (f"--threads {p.threads_option()} (the profile measured {','.join(map(str, sorted(set(base))))}: costs "
            f"extrapolated, speed-up (threads ratio within the usable CPUs) ** {THREAD_SCALING})")


def job_topology(model_path, model_label: str, n_ranks: int, layer_split, draft_path, draft, job_drafts: bool,
                 mode: str, profile_path, n_ctx: int, load: tuple[int, str] = (1, "yield")):
    """The planner's Topology of the job that runs `mode` (job_drafts: a draft model on the head takes
    layers from it), as `plan` and `-M auto` both plan it; load: requests at once and the load
    policy (serve --parallel N --load-policy P), which --layer-split auto balances the stages for."""
    from .predict import Topology

    t = plan_job(model_path, model_label, n_ranks, 1, layer_split, None, draft_path, job_drafts,
                 has_draft=bool(draft), profile_path=profile_path, n_ctx=n_ctx,
                 load=load)
    stages = [r for r in t.ranks if r.role != "draft"]
    if needs_draft(mode):
        where = LOOKUP if draft.is_free else (t.draft_rank if t.draft_rank is not None else "head")
        return Topology([r.rank for r in stages], [r.layers for r in stages], where)
    return Topology([r.rank for r in stages], [r.layers for r in stages], None)


def job_threads(prof, mode: str, threads: str | None, n_ranks: int) -> list[int]:
    """The threads of each rank of the job `generate -M MODE` would start on the profile's hosts
    (--threads as given, else generate's default for that mode and shape)."""
    hosts = [prof.ranks[r].host for r in range(n_ranks)]
    if threads:
        return parse_threads(threads, n_ranks)  # explicit: the same on every host
    one_host = len(set(hosts)) == 1
    out = []
    for r in range(n_ranks):
        rc = prof.ranks[r]
        affinity = rc.affinity_cpus if rc.affinity_cpus is not None else rc.cores
        out.append(default_threads(not needs_draft(mode), n_ranks, hosts.count(hosts[r]), rc.cores, affinity,
                                   rc.quota_cpus, one_host))
    return out
