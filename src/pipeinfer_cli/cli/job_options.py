"""The options every job command shares (generate, chat, serve, bench), declared once.

`@job_options` adds them to a Typer command's signature and hands them to the command as one
`job: JobOptions` object, so the commands neither repeat the option list nor a long keyword call.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from dataclasses import dataclass

from ..transport.deadlines import DEFAULT_RANK_TIMEOUT_S
from . import options as o


@dataclass
class JobOptions:
    """Option values shared by every command that runs a job (see `pipeinfer generate --help`)."""

    draft: o.DraftOption = None
    n_predict: o.NPredictOption = 128
    temp: o.TempOption = 0.0
    top_k: o.TopKOption = 40
    top_p: o.TopPOption = 0.95
    min_p: o.MinPOption = 0.0
    seed: o.SeedOption = 0
    n_draft: o.NDraftOption = 4
    draft_min: o.DraftMinOption = 0
    p_min: o.PMinOption = 0.0
    p_accept: o.PAcceptOption = 0.5
    p_split: o.PSplitOption = 0.1
    p_recovery: o.PRecoveryOption = 0.0
    p_decay: o.PDecayOption = 0.0
    max_branches: o.MaxBranchesOption = 1
    max_inflight: o.MaxInflightOption = 4
    p_reach: o.PReachOption = 0.5
    spec_policy: o.SpecPolicyOption = "auto"
    ranks: o.JobRanksOption = None
    layer_split: o.LayerSplitOption = None
    profile: o.ProfileOption = None
    threads: o.ThreadsOption = None
    ctx: o.CtxOption = 4096
    ubatch: o.UbatchOption = None
    rank_timeout: o.RankTimeoutOption = DEFAULT_RANK_TIMEOUT_S
    no_pull: o.NoPullOption = False


def job_options(command=None, **defaults):
    """Decorator: the command's `job: JobOptions` parameter becomes the shared options, in its place.

    `@job_options(n_predict=-1)` gives the command other defaults for some of them."""
    if command is None:
        return functools.partial(job_options, **defaults)
    unknown = set(defaults) - {f.name for f in dataclasses.fields(JobOptions)}
    if unknown:
        raise TypeError(f"no shared job option {', '.join(sorted(unknown))}")
    hints = typing.get_type_hints(command, include_extras=True)
    own = inspect.signature(command).parameters
    if "job" not in own:
        raise TypeError(f"{command.__name__} needs a `job: JobOptions` parameter")
    job_hints = typing.get_type_hints(JobOptions, include_extras=True)
    shared = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=defaults.get(f.name, f.default),
                                annotation=job_hints[f.name])
              for f in dataclasses.fields(JobOptions)]
    params = []
    for p in own.values():
        if p.name == "job":
            params.extend(shared)
        else:
            params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints.get(p.name, p.annotation)))
    names = {p.name for p in shared}

    @functools.wraps(command)
    def wrapper(**kwargs):
        job = JobOptions(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        return command(**kwargs, job=job)

    wrapper.__signature__ = inspect.Signature(params, return_annotation=None)
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    del wrapper.__wrapped__  # Typer must see the new signature, not the command's own
    return wrapper
