"""What a job command gives the planner (planner/job_plan.py) for `-M auto` and `--layer-split
auto`, and what it hands down to the job it starts.

The planner chooses (planner/auto_choice.py); the command gives it the profile of its ranks
(--profile, else one calibrated quickly and cached: cli/auto_profile.py), the prompt's tokens (prompt
lookup's acceptance is measured on them, for `generate`, whose command has the prompt), the profiles
cached at other thread counts, and whether this process plans the job (the launching command, or
rank 0 of a job its user launched). The launching command's choice is inherited by the ranks of the
job it starts (CHOICE_ENV, PLACEMENT_ENV), which take it instead of deciding again: a rank does not
have the prompt, and every rank must run the same settings. Between requests (chat turns, serve),
planner/replan.Replanner plans the settings again, for the same mode, when the acceptance measured
so far leaves the one planned on by a margin; never inside a request.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..planner.job_plan import AUTO, ClusterFacts, JobPlan, PlanRequest

if TYPE_CHECKING:
    from ..planner.job_config import JobConfig

# The launching command's decisions, inherited by the ranks of the job it starts, which take them
# instead of deciding again (a rank does not have the prompt; every rank must run the same settings).
CHOICE_ENV = "PIPEINFER_AUTO_CHOICE"


# The placement --layer-split auto chose (without -M auto), for the ranks of the job started next.
PLACEMENT_ENV = "PIPEINFER_AUTO_PLACEMENT"


def split_auto(cfg: JobConfig) -> bool:
    return bool(cfg.layer_split) and cfg.layer_split.startswith("auto")


def with_profile(cfg: JobConfig, model: str, job, n_ranks: int, auto: bool, inside: bool, say) -> JobConfig:
    """The configuration with the profile that -M auto and --layer-split auto need: given, cached, or
    calibrated now (cli/auto_profile.py); the ranks of the job started next are given it as their
    --profile. say(line): stderr, once per job."""
    if cfg.profile is None and (auto or split_auto(cfg)) and (cfg.model_path is not None or inside):
        from .auto_profile import ensure_profile
        from .options import PROFILE_ENV

        why = "-M auto" if auto else "--layer-split auto"
        cfg = replace(cfg, profile=ensure_profile(cfg, model, job, n_ranks, why, inside, say))
        if not inside and cfg.profile is not None:
            os.environ[PROFILE_ENV] = str(cfg.profile)  # the ranks of the job started next: their --profile
    return cfg


def inherited(request: PlanRequest, inside: bool) -> PlanRequest:
    """The request with the choice the launching command made (a rank of the job it started)."""
    if not inside:
        return request
    if request.mode == AUTO and os.environ.get(CHOICE_ENV):
        from ..planner.auto_choice import from_env

        return replace(request, inherited=from_env(os.environ[CHOICE_ENV], request.cfg.decode))
    if request.mode != AUTO and split_auto(request.cfg) and os.environ.get(PLACEMENT_ENV):
        return replace(request, inherited_split=os.environ[PLACEMENT_ENV])
    return request


def cluster_facts(cfg: JobConfig, job, n_ranks: int, on_head: bool, given) -> ClusterFacts:
    """What this process knows for the plan: its threads' default, whether it plans and can read the
    profile, and (asked for only where the planner needs them) the prompt's tokens and the profiles
    of these ranks at other thread counts."""
    from ..runtime.topology import default_threads
    from .auto_profile import measured_profiles

    usable = cfg.model_path is not None and cfg.profile is not None and (on_head or Path(cfg.profile).is_file())
    return ClusterFacts(default_threads(n_ranks), on_head, usable, lambda: prompt_tokens(cfg, given),
                        lambda: measured_profiles(cfg, job, n_ranks))


def hand_down(request: PlanRequest, plan: JobPlan, inside: bool) -> None:
    """The launching command's choices, for the ranks of the job it starts next."""
    if inside:
        return
    if plan.auto is not None:
        os.environ[CHOICE_ENV] = json.dumps(plan.auto.to_json())
    elif request.mode != AUTO and plan.cfg.layer_split != request.cfg.layer_split:
        os.environ[PLACEMENT_ENV] = plan.cfg.layer_split


def prompt_tokens(cfg: JobConfig, given) -> list[int] | None:
    """The prompt's tokens (target vocabulary), to measure prompt lookup on, when the command has one."""
    if given is None or (given.text is None and given.messages is None):
        return None
    from ..runtime.tokenizer import Tokenizer

    tok = Tokenizer(cfg.model_path)
    try:
        return tok.chat_messages(given.messages) if given.messages is not None else tok.encode(given.text)
    finally:
        tok.close()

