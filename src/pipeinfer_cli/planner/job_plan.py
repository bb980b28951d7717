"""A job's plan, made once before the job starts: its mode, its ranks, who holds which layers and
where the draft runs, each rank's threads, the mode's settings (n_draft, p_accept, max_inflight, in
the configuration's DecodeOptions), and what `-M auto` chose and on what acceptance.

`make_plan` makes it in one pass, from the request (the command's options with its models
resolved: a `PlanRequest`), the facts of the cluster this process knows (`ClusterFacts`: whether it
plans for the job, the threads a rank finds on its host, the prompt's tokens and the profiles cached
at other thread counts) and the profile the request names:

1. the mode: the one asked for, the default for the draft, or `-M auto`'s choice
   (planner/auto_choice.py: the search over modes, settings and placements), which also sets the
   settings, the threads and, where the planner places the job, its --layer-split;
2. else, for `--layer-split auto` and a mode that drafts, where the draft runs
   (planner/auto_choice.place);
3. the layout (planner/layout.py): the roles and layers of every rank from the GGUF header, by
   bytes or, for --layer-split auto, by the profile's measured time within each rank's memory
   (planner/split.py, which refuses a split that does not fit).

A choice the launching command made is inherited by the ranks of the job it starts (they do not
have the prompt, and every rank must run the same settings): `PlanRequest.inherited`. The front
ends (cli/) ask for the plan once and print it; the runtime (runtime/job.py) carries it out,
filling in only what a running rank alone knows: the threads of ranks without --threads, from the
ranks per host its start-up counted (`JobPlan.on_hosts`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..decode.modes import check_mode, needs_draft
from .auto_choice import AutoChoice, choose, place
from .job_config import JobConfig
from .job_placement import draft_kind, split_is_chosen
from .layout import Topology, is_auto_split, parse_threads, plan_job

AUTO = "auto"


@dataclass(frozen=True)
class PlanRequest:
    """What a job command asks for: its configuration (the options, models resolved) and the rest
    of the options that decide how it runs."""

    cfg: JobConfig
    mode: str | None  # -M as given: a mode, "auto", or None (the default for the draft)
    ranks: int
    explicit_ranks: bool = False  # --ranks or --layer-split said how many
    drafts: bool | None = None  # the job runs its draft, if it has one, whatever its mode; None: where its mode drafts
    trace_draft: bool = False  # a request records the draft model's chains (--save-trace): it loads the draft
    place: bool = True  # --layer-split auto may place the draft for the job's mode (bench runs every mode: no)
    inherited: AutoChoice | None = None  # -M auto's choice, made by the command that started this job
    inherited_split: str | None = None  # --layer-split auto's placement, made by the command that started this job


@dataclass(frozen=True)
class ClusterFacts:
    """What this process knows of the job's cluster when it plans."""

    default_threads: int = 1  # a rank's threads without --threads (its host's share: runtime/topology.py)
    on_head: bool = True  # this process plans the job: the launching command, or the job's rank 0
    profile_usable: bool = False  # the profile named can be read here (-M auto and --layer-split auto need it)
    prompt_tokens: Callable[[], list[int] | None] = lambda: None  # the prompt, for prompt lookup's acceptance
    measured: Callable[[], dict] = dict  # {threads: Profile} of these ranks at other thread counts


@dataclass(frozen=True)
class JobPlan:
    """Everything decided about a job before it runs (the module doc)."""

    cfg: JobConfig  # what every rank runs with: the request's, with the plan's settings, threads and split
    mode: str
    ranks: int
    explicit_ranks: bool
    drafts: bool  # the job runs its draft (loads a draft model, drafts by lookup)
    layout: Topology | None  # roles, layers and threads of every rank; None: a rank that takes the head's plan
    auto: AutoChoice | None = None  # -M auto's choice, when it chose
    mode_drafts: bool = False  # the mode drafts (decode/modes.needs_draft): its stages compute at once

    @property
    def has_draft(self) -> bool:
        return not self.cfg.draft.is_none

    @property
    def layer_split(self) -> str | None:
        """The --layer-split the job runs (-M auto's or --layer-split auto's placement in layer counts)."""
        return self.cfg.layer_split

    @property
    def memory(self):
        """What --layer-split auto fitted in each rank's memory with the weights (planner.split.JobMemory:
        the KV cache, a draft model where it runs; planner/split.check_memory refused a split that does
        not fit); None: a split by bytes or fractions (the runtime checks a rank's memory as it loads)."""
        return None if self.layout is None else self.layout.memory

    def on_hosts(self, default_threads: int, world_size: int | None = None) -> Topology:
        """The layout as a running job carries it out: each rank's threads --threads as planned, else
        default_threads (the share of its host the head finds, with the ranks per host start-up counted).
        world_size: the job's ranks, for a plan that has no layout yet (runtime/job.py's bare
        configurations lay themselves out here); this plan's layout holds them."""
        layout = self.layout
        threads = parse_threads(self.cfg.threads, layout.world_size, default_threads)
        ranks = [replace(r, threads=t) for r, t in zip(layout.ranks, threads)]
        return replace(layout, ranks=ranks)


def make_plan(request: PlanRequest, facts: ClusterFacts, say: Callable[[str], None] = lambda line: None) -> JobPlan:
    """The job's plan, in one pass (the module doc). say(line): the lines a user reads on stderr
    (-M auto's choice, --layer-split auto's placement, an assumed acceptance)."""
    cfg, n = request.cfg, request.ranks
    auto = request.mode == AUTO
    mode = check_mode(None if auto else request.mode, bool(cfg.draft))
    choice = None
    if auto:
        choice = request.inherited or _choose(cfg, n, facts, say)
        if choice is not None:
            split = cfg.layer_split if choice.layer_split is None else choice.layer_split
            mode = choice.mode
            cfg = replace(cfg, layer_split=split, decode=choice.decode, threads=choice.job_threads)
            say(choice.announce())
    elif _split_auto(cfg):
        cfg = _placed(cfg, request, mode, facts, say)
    mode_drafts = needs_draft(mode)
    if request.drafts is None:
        drafts = mode_drafts or (request.trace_draft and cfg.draft.uses_model)
    else:
        drafts = request.drafts and not cfg.draft.is_none
    layout = layout_of(cfg, n, facts.default_threads, drafts) if facts.on_head and cfg.model_path is not None else None
    return JobPlan(cfg, mode, n, request.explicit_ranks, drafts, layout, choice, mode_drafts)


def layout_of(cfg: JobConfig, world_size: int, default_threads: int, drafts: bool) -> Topology:
    """The roles, layers and threads of a job's ranks from its configuration (planner/layout.plan_job);
    a profile that --layer-split auto splits by is checked against the model file's sha256, taken
    here once (planner/identity.model_sha256)."""
    from .identity import model_sha256

    by_profile = cfg.profile is not None and is_auto_split(cfg.layer_split)
    return plan_job(cfg.model_path, cfg.model_label, world_size, default_threads, cfg.layer_split, cfg.threads,
                    cfg.draft_path, drafts, has_draft=not cfg.draft.is_none,
                    profile_path=cfg.profile, n_ctx=cfg.engine_ctx,
                    model_sha256=model_sha256(cfg.model_path) if by_profile else None,
                    load=(cfg.parallel, cfg.load_policy))


def _split_auto(cfg: JobConfig) -> bool:
    return bool(cfg.layer_split) and cfg.layer_split.startswith("auto")


def _choose(cfg: JobConfig, n_ranks: int, facts: ClusterFacts, say) -> AutoChoice | None:
    """-M auto's choice where this process plans the job and can read its profile; None elsewhere (a
    rank other than the head of a job its user launched takes the head's plan, runtime/weight_stream.py,
    and runs with the default mode meanwhile)."""
    if not facts.profile_usable or not facts.on_head:
        return None
    tokens = facts.prompt_tokens() if cfg.draft.is_free else None
    return choose(cfg, n_ranks, bool(cfg.draft), tokens, facts.measured(), say)


def _placed(cfg: JobConfig, request: PlanRequest, mode: str, facts: ClusterFacts, say) -> JobConfig:
    """--layer-split auto without -M auto: the launching command's placement, else, for a mode that
    drafts and a split the planner chooses, the placement the search predicts fastest."""
    if request.inherited_split:
        return replace(cfg, layer_split=request.inherited_split)
    if (facts.profile_usable and facts.on_head and request.place and draft_kind(cfg, mode) is not None
            and split_is_chosen(cfg, request.ranks)):
        tokens = facts.prompt_tokens() if cfg.draft.is_free else None
        return place(cfg, mode, request.ranks, tokens, say)
    return cfg
