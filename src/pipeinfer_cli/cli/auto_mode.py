"""`-M auto`: the mode and settings the plan predicts fastest for this job's ranks and draft.

The prediction runs the real policies in virtual time (planner/) on the profile of these ranks.
Before a request has run, what the draft will get right is not known: every draft (a model of any
size, prompt lookup) is assumed right DEFAULT_ACCEPTANCE of the time (calibrate does not measure
acceptance: it depends on the prompts), and the job says so on stderr when it starts and on its
summary line, beside the measured speed. Every process of the job
makes the same choice (the simulation is deterministic), so no message is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import UsageError

AUTO = "auto"
DEFAULT_ACCEPTANCE = 0.6  # assumed for every draft; -M's help and docs/plan.md state it
AUTO_PROMPT = 128  # tokens of the typical request the choice is made for
AUTO_GEN = 96
# A small grid: the choice is made at every start.
N_DRAFT = (2, 3, 4, 6)
P_ACCEPT = (0.3, 0.5, 0.7)
MAX_INFLIGHT = (2, 4)


@dataclass
class AutoChoice:
    mode: str
    decode: object  # DecodeOptions
    predicted_tok_per_s: float | None
    acceptance: float  # the assumed acceptance rate
    threads: str = ""  # the profile's threads per rank, which the job runs with (--threads)

    def describe(self) -> str:
        d = self.decode
        knobs = "" if self.mode == "iterative" else f" n_draft {d.n_draft}"
        if self.mode == "pipeinfer":
            knobs += f", p_accept {d.p_accept}, max_inflight {d.max_inflight}"
        pred = "" if self.predicted_tok_per_s is None else f", predicted {self.predicted_tok_per_s:.2f} tok/s"
        return f"auto chose {self.mode}{' (' + knobs.strip() + ')' if knobs else ''}{pred}"

    def announce(self) -> str:
        """The job's start-up line: what auto chose and on what acceptance."""
        return (f"pipeinfer: -M {self.describe()}, on an assumed acceptance of {self.acceptance:.0%} (not measured: "
                f"`pipeinfer plan --trace` replays a real draft's), run with the profile's --threads {self.threads}")


def choose(cfg, n_ranks: int, has_draft: bool) -> AutoChoice:
    """The fastest predicted mode and settings for this job (cfg: a JobConfig with a profile)."""
    from ..decode.modes import MODE_NAMES, needs_draft
    from ..planner.plan import Replay, run_mode, summarize
    from ..planner.predict import Topology
    from ..planner.profile import DraftCosts, Profile
    from ..planner.replay import PromptTrace
    from ..runtime.topology import plan_job

    if cfg.profile is None:
        raise UsageError("-M auto needs a profile of the ranks: run `pipeinfer calibrate MODEL --ranks N --out "
                         "profile.json` (with the draft), then pass --profile profile.json")
    prof = Profile.load(cfg.profile)
    from ..planner.identity import model_sha256

    prof.check_model(cfg.model_label, cfg.model_path.stat().st_size, f"the profile {cfg.profile}",
                     model_sha256(cfg.model_path, cfg.model_sha256, cfg.model_size))
    if len(prof.ranks) < n_ranks:
        raise UsageError(f"-M auto: the profile measured {len(prof.ranks)} rank(s) but the job has {n_ranks}; "
                         "calibrate with as many ranks as the job runs")
    threads = job_threads(prof, cfg, n_ranks)
    lookup = cfg.draft.is_lookup
    if lookup:  # prompt lookup: a free drafter whose hits are assumed, like a model's
        prof = replace(prof, draft=DraftCosts("model", "lookup", 0, 1, 2e-5, 0.0))
    acceptance = DEFAULT_ACCEPTANCE
    n_gen = cfg.decode.n_predict if 0 < cfg.decode.n_predict < AUTO_GEN else AUTO_GEN
    pt = PromptTrace("auto", list(range(1000, 1000 + AUTO_PROMPT)), [2000 + i for i in range(n_gen)], "length")
    replay = Replay([pt], acceptance)
    best = None
    for mode in MODE_NAMES:
        if needs_draft(mode) and (not has_draft or prof.draft is None):
            continue
        t = plan_job(cfg.model_path, cfg.model_label, n_ranks, n_ranks, cfg.layer_split, None, cfg.draft_path,
                     needs_draft(mode), has_draft=has_draft, profile_path=cfg.profile)
        stages = [r for r in t.ranks if r.role != "draft"]
        draft = None if not needs_draft(mode) else (t.draft_rank if t.draft_rank is not None else "head")
        topo = Topology([r.rank for r in stages], [r.layers for r in stages], draft)
        for opts in _candidates(mode, cfg.decode):
            speed = summarize(run_mode(prof, topo, mode, replay, opts, cfg.n_ctx)).tok_per_s
            if speed is not None and (best is None or speed > best.predicted_tok_per_s):
                best = AutoChoice(mode, opts, speed, acceptance, threads)
    return best


def job_threads(prof, cfg, n_ranks: int) -> str:
    """The threads the job runs with: the profile's, which its predictions are for (a job's default
    differs by mode, and -M auto compares modes on the profile's). --threads other than the
    profile's is refused: the profile did not measure that job."""
    from ..runtime.topology import parse_threads

    measured = [rc.threads for rc in prof.ranks[:n_ranks]]
    if cfg.threads is not None:
        given = parse_threads(cfg.threads, n_ranks, 1)
        if given != measured:
            raise UsageError(f"-M auto: the profile {cfg.profile} was made for {_per_rank(measured)}, this job uses "
                             f"{_per_rank(given)}: run `pipeinfer calibrate {cfg.model_label} --ranks {n_ranks} "
                             f"--threads {cfg.threads}`, or drop --threads (-M auto runs with the profile's)")
    return ",".join(map(str, measured)) if len(set(measured)) > 1 else str(measured[0])


def _per_rank(threads: list[int]) -> str:
    from ..wording import plural

    return f"{plural(threads[0], 'thread')} per rank" if len(set(threads)) == 1 else "threads " + ",".join(map(str, threads))


def _candidates(mode: str, opts) -> list:
    if mode == "iterative":
        return [opts]
    if mode == "speculative":
        return [replace(opts, n_draft=k) for k in N_DRAFT]
    return [replace(opts, n_draft=k, p_accept=p, max_inflight=f) for k in N_DRAFT for p in P_ACCEPT for f in MAX_INFLIGHT]
