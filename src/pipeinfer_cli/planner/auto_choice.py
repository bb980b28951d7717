"""`-M auto`'s choice: the mode, settings, placement and threads the plan predicts fastest for a
job's ranks and draft; and `--layer-split auto`'s placement of a drafting mode.

The search is the planner's (planner/search.py: the one `plan --search` runs), over the placements
of planner/job_placement.py (where the draft runs, how many layers the head holds, each rank's
threads), on the profile of these ranks (--profile, else one calibrated quickly and cached:
cli/auto_profile.py), for the request the job will run, with the draft's acceptance measured where
it can be (planner/acceptance.py: on the prompt itself for lookup; by `calibrate --draft` for a
model) and assumed (DEFAULT_ACCEPTANCE) where not. The job says what it chose, and on what
acceptance, on stderr when it starts, and `generate`'s summary line sets the predicted speed beside
the measured one. Every process of the job makes the same choice (the simulation is deterministic),
so no message is needed. planner/job_plan.py asks for it while it plans a job.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..decode.session import DecodeOptions
from ..errors import UsageError
from .acceptance import DEFAULT_ACCEPTANCE, Acceptance
from .job_config import JobConfig
from .job_placement import job_placements, job_threads, job_topology, placement_note, split_is_chosen, threads_note


@dataclass
class AutoChoice:
    mode: str
    decode: DecodeOptions
    predicted_tok_per_s: float | None
    acceptance: Acceptance  # what the draft was planned to get right, and how that was obtained
    threads: str = ""  # the threads per rank the job runs with (--threads)
    layer_split: str | None = None  # the placement chosen (--layer-split in layer counts); None: the job's own
    placement: str = ""  # how: "draft on rank 3 of its own", ...; and what the other candidates predicted
    threads_how: str = ""  # where the threads' costs came from (the profile's, measured, extrapolated)
    threads_default: bool = False  # they are what the job starts with by default for the mode (no --threads)

    @property
    def job_threads(self) -> str | None:
        """The job's --threads: None where the chosen threads are the mode's default (so the job
        starts as `generate -M MODE` would, e.g. an iterative job's ranks spinning on the whole host)."""
        return None if self.threads_default else self.threads

    def describe(self) -> str:
        d = self.decode
        knobs = "" if self.mode == "iterative" else f" n_draft {d.n_draft}"
        if self.mode == "pipeinfer":
            knobs += f", p_accept {d.p_accept}, max_inflight {d.max_inflight}"
        pred = "" if self.predicted_tok_per_s is None else f", predicted {self.predicted_tok_per_s:.2f} tok/s"
        return f"auto chose {self.mode}{' (' + knobs.strip() + ')' if knobs else ''}{pred}"

    def announce(self) -> str:
        """The job's start-up line: what auto chose, where, and on what acceptance."""
        on = "" if self.acceptance.rate is None else f", on {self.acceptance.describe()}"
        where = "" if self.layer_split is None else f", --layer-split {self.layer_split} ({self.placement})"
        threads = self.threads_how or f"the profile's --threads {self.threads}"
        return f"pipeinfer: -M {self.describe()}{where}{on}, run with {threads}"

    def to_json(self) -> dict:
        """The choice (generate --json's "auto"; CHOICE_ENV carries it to the job's ranks)."""
        a, d = self.acceptance, self.decode
        return {"mode": self.mode, "n_draft": d.n_draft, "p_accept": d.p_accept, "max_inflight": d.max_inflight,
                "predicted_tok_per_s": self.predicted_tok_per_s, "threads": self.threads,
                "layer_split": self.layer_split, "placement": self.placement, "threads_how": self.threads_how,
                "threads_default": self.threads_default,
                "acceptance": {"rate": a.rate, "measured": a.measured, "source": a.source}}

    def summary(self, measured_tok_per_s: float | None) -> str:
        """For generate's summary line: the choice, its acceptance, and predicted against measured speed."""
        how = "measured" if self.acceptance.measured else "assumed"
        speed = "" if measured_tok_per_s is None else f" against {measured_tok_per_s:.2f} measured"
        if self.acceptance.rate is None:
            return f"{self.describe()}{speed}"
        return f"{self.describe()}{speed} (planned on acceptance {how} {self.acceptance.rate:.0%})"


def choose(cfg: JobConfig, n_ranks: int, has_draft: bool, prompt_tokens: list[int] | None = None,
           measured: dict | None = None, say=None) -> AutoChoice:
    """The fastest predicted mode, settings and placement for this job (cfg: a JobConfig with a
    profile). prompt_tokens: the request's prompt, when the job knows it before it starts
    (generate). measured: {threads: Profile} of these ranks at other thread counts (cached
    calibrations), which the search takes instead of extrapolating. say(line): stderr."""
    from ..decode.modes import MODE_NAMES, needs_draft
    from . import search

    prof = _checked_profile(cfg, n_ranks, "-M auto")
    lookup = cfg.draft.is_free  # suffix drafting is planned as prompt lookup (DraftSpec.planned)
    modes = [m for m in MODE_NAMES if not needs_draft(m) or (has_draft and (lookup or _has_model_costs(prof)))]
    acceptance = draft_acceptance(cfg, prof, prompt_tokens)
    if acceptance.rate is not None and not acceptance.measured and say is not None:
        say(f"pipeinfer: -M auto: warning: planning on an assumed draft acceptance of {acceptance.rate:.0%}: "
            f"{acceptance.source.removeprefix('assumed: ')}; `pipeinfer calibrate --draft` measures it")
    replay = _replay(cfg, acceptance, prompt_tokens)

    def topo_of(mode: str):
        return job_topology(cfg.model_path, cfg.model_label, n_ranks, cfg.layer_split, cfg.draft_path, cfg.draft,
                            needs_draft(mode), mode, cfg.profile, cfg.n_ctx)

    places = lambda m: job_placements(cfg, prof, n_ranks, m, replay, measured)  # noqa: E731
    c = search.choose(prof, topo_of, modes, replay, cfg.decode, cfg.n_ctx, placements_of=places)
    p = c.placement
    chosen_split = p.layer_split() if split_is_chosen(cfg, n_ranks) else None
    default = cfg.threads is None and p.threads == job_threads(prof, c.mode, None, n_ranks)
    return AutoChoice(c.mode, c.opts, c.tok_per_s, acceptance, p.threads_option(), chosen_split,
                      placement_note(c.per_mode[c.mode]), threads_note(prof, p, measured), default)


def _checked_profile(cfg: JobConfig, n_ranks: int, why: str):
    from .identity import model_sha256
    from .profile import Profile

    if cfg.profile is None:
        raise UsageError(f"{why} needs a profile of the ranks: run `pipeinfer calibrate MODEL --ranks N --out "
                         "profile.json` (with the draft), then pass --profile profile.json")
    prof = Profile.load(cfg.profile)
    prof.check_model(cfg.model_label, cfg.model_path.stat().st_size, f"the profile {cfg.profile}",
                     model_sha256(cfg.model_path, cfg.model_sha256, cfg.model_size))
    if len(prof.ranks) < n_ranks:
        raise UsageError(f"{why}: the profile measured {len(prof.ranks)} rank(s) but the job has {n_ranks}; "
                         "calibrate with as many ranks as the job runs")
    return prof


def _replay(cfg: JobConfig, acceptance: Acceptance, prompt_tokens: list[int] | None):
    from . import search
    from .plan import Replay

    n_gen = cfg.decode.n_predict if 0 < cfg.decode.n_predict < search.AUTO_GEN else search.AUTO_GEN
    rate = DEFAULT_ACCEPTANCE if acceptance.rate is None else acceptance.rate  # no draft: no mode drafts
    return Replay([search.auto_request(prompt_tokens, n_gen)], rate, confidences=acceptance.confidences)


def _has_model_costs(prof) -> bool:
    return prof.draft is not None and prof.draft.kind == "model"


def draft_acceptance(cfg: JobConfig, prof, prompt_tokens: list[int] | None) -> Acceptance:
    """The acceptance -M auto plans with: measured where it can be (the module doc), else assumed."""
    from .acceptance import assumed, from_profile, lookup_on_prompt

    if not cfg.draft:
        return Acceptance(None, False, "no draft")
    if cfg.draft.is_free:  # suffix drafting too: prompt lookup's acceptance is its floor
        if prompt_tokens:
            return lookup_on_prompt(prompt_tokens)
        return assumed("prompt lookup, before any prompt is known")
    note = prof.draft.acceptance_note if prof.draft is not None else None
    why = f"calibrate did not measure the draft's acceptance: {note}" if note else \
        "the profile's calibration did not measure the draft's acceptance"
    return from_profile(prof.draft) or assumed(why)


def place(cfg: JobConfig, mode: str, n_ranks: int, prompt_tokens_: list[int] | None, say) -> JobConfig:
    """--layer-split auto without -M auto, for a mode that drafts: the placement the search
    predicts fastest for the job's mode and settings at its threads (planner/placement.py), said on
    stderr; the configuration with it as the job's --layer-split."""
    from .search import search_placed

    prof = _checked_profile(cfg, n_ranks, "--layer-split auto")
    acceptance = draft_acceptance(cfg, prof, prompt_tokens_)
    if acceptance.rate is not None and not acceptance.measured:
        say(f"pipeinfer: --layer-split auto: warning: placing the draft on an assumed acceptance of "
            f"{acceptance.rate:.0%}: {acceptance.source.removeprefix('assumed: ')}")
    replay = _replay(cfg, acceptance, prompt_tokens_)
    threads = [job_threads(prof, mode, cfg.threads, n_ranks)]
    cands = job_placements(cfg, prof, n_ranks, mode, replay, threads=threads)
    best = search_placed(cands, mode, replay, cfg.decode, cfg.n_ctx) if len(cands) > 1 else None
    if best is None:
        return cfg
    split = best.placement.layer_split()
    pred = "" if best.tok_per_s is None else f", predicted {best.tok_per_s:.2f} tok/s"
    say(f"pipeinfer: --layer-split auto placed the job: --layer-split {split} ({placement_note(best)}){pred}")
    return replace(cfg, layer_split=split)


def from_env(text: str, decode: DecodeOptions) -> AutoChoice:
    """The launching command's choice (cli/auto_mode.CHOICE_ENV) for a job with the same options (decode: the job's)."""
    import json

    d = json.loads(text)
    a = d["acceptance"]
    opts = replace(decode, n_draft=d["n_draft"], p_accept=d["p_accept"], max_inflight=d["max_inflight"])
    return AutoChoice(d["mode"], opts, d["predicted_tok_per_s"], Acceptance(a["rate"], a["measured"], a["source"]),
                      d["threads"], d.get("layer_split"), d.get("placement", ""), d.get("threads_how", ""),
                      d.get("threads_default", False))
