"""What every job command (generate, chat, serve, calibrate, bench) does before its job starts: models,
rank count, MPI world, JobConfig, the job's plan (planner/job_plan.py, asked for once), and the
relaunch under mpiexec (transport/launch.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import typer

from ..decode.draft_spec import MODEL, DraftSpec
from ..errors import ModelFileError, OptionValueError, UsageError
from ..models.registry import load_registry
from ..transport.start_waits import launcher_rank

if TYPE_CHECKING:
    from ..models.model_files import ModelRef
    from ..planner.auto_choice import AutoChoice
    from ..planner.job_config import JobConfig
    from ..planner.job_plan import JobPlan
    from .job_options import JobOptions


def resolve_models(model: str, draft: DraftSpec, allow_pull: bool, on_head: bool = True):
    """(target ModelRef, draft ModelRef or None, DraftSpec) from a model/pair name or paths: a
    pair's draft stands in for no --draft; the spec names its model by the resolved label.

    allow_pull: a registry model missing from the cache is downloaded first, announced by one line
    on stderr; otherwise it is the error `model … is not downloaded; run pipeinfer models pull …`.
    on_head: False on the other ranks of an MPI job, which may lack the files (the head sends
    them their weights), so a missing model is not an error there."""
    from ..models.cache import cached_model_path, ensure_writable_cache
    from ..models.model_files import resolve_model
    from .model_pull import announce_pull, pull_with_progress
    from .options import NO_PULL_ENV

    reg = load_registry()
    if model in reg.pairs:
        pair = reg.pairs[model]
        # A pair's draft is a model of the registry (load_registry checks it): a model spec as it stands.
        model, draft = pair.target, draft or DraftSpec(MODEL, pair.draft)

    def ref(name: str):
        if allow_pull and name in reg.models and not cached_model_path(reg.models[name]).exists():
            ensure_writable_cache()  # a clear error before any progress bar is drawn
            source = reg.models[name].source
            for needed in ([source.model] if source.requantized else []) + [name]:
                if not cached_model_path(reg.models[needed]).exists():
                    announce_pull(reg, needed, f"--no-pull or {NO_PULL_ENV}=1 refuses")
            pull_with_progress(reg, name)
        try:
            return resolve_model(name, reg, missing_ok=not on_head)
        except ModelFileError as exc:
            raise _missing_on_head(name, exc) from None

    target = ref(model)
    if not draft.uses_model:
        return target, None, draft
    draft_ref = ref(draft.model)
    return target, draft_ref, draft.resolved(draft_ref.label)


def _missing_on_head(name: str, exc: ModelFileError) -> ModelFileError:
    """In a job of several ranks the head is the one node that needs the models: say so, and where."""
    import socket

    from ..transport.launch import under_mpi_launcher

    if not under_mpi_launcher() or launcher_rank() != 0:
        return exc  # not a job's head
    if "does not exist" not in str(exc) and "not downloaded" not in str(exc):
        return exc
    how = f"run `pipeinfer models pull {name}` there" if not name.endswith(".gguf") and "/" not in name else "copy it there"
    return ModelFileError(f"model {name!r} is not on the head's host ({socket.gethostname()}), which needs every model "
                          f"of the job (the other ranks are sent their layers from it); {how}")


def check_chat_template(model_path, model_label: str, what: str) -> None:
    """A chat prompt (what: the options or prompts that ask for one) needs the target's chat
    template; refuse it from the GGUF header before any process starts. Base models such as
    Gemma 3 270M have none."""
    from ..models.gguf_info import read_model_info

    if model_path is None:
        return  # a rank without the file: the head checks
    if not read_model_info(model_path).chat_template:
        raise UsageError(f"{model_label} has no chat template in its GGUF metadata, so {what} cannot be formatted "
                         "as a chat; give the raw text with -p/--prompt (or -f FILE) instead")


def ranks_wanted(ranks: int | None, layer_split: str | None) -> tuple[int, int | None]:
    """(ranks to run, ranks described by --layer-split or None); checks the two agree. Without
    either: the ranks a launcher started this process among (`mpiexec -n 2 pipeinfer …`), else 1."""
    from ..planner.layout import split_rank_count
    from ..transport.start_waits import launcher_size

    split_ranks = split_rank_count(layer_split)
    if split_ranks is not None:
        if ranks is not None and ranks != split_ranks:
            raise UsageError(f"--layer-split {layer_split!r} describes {split_ranks} ranks but --ranks is {ranks}")
    return ranks or split_ranks or launcher_size() or 1, split_ranks


def check_world(want: int, explicit: bool) -> None:
    """Inside the MPI job: the world size must match what the options asked for."""
    from mpi4py import MPI

    from ..transport.launch import RELAUNCHED

    world = MPI.COMM_WORLD.Get_size()
    if explicit and world != want and not os.environ.get(RELAUNCHED):
        raise UsageError(f"the MPI job has {world} ranks but the options ask for {want}; start it with -n {want}")


def check_n_predict(n_predict: int) -> None:
    if n_predict == 0 or n_predict < -1:
        raise OptionValueError(f"-n/--n-predict must be a number of tokens >= 1, or -1 for 'until end of generation' "
                               f"(got {n_predict})")


def default_mode(mode: str | None, draft_ref) -> str:
    """The mode asked for; without one, pipeinfer (the product's mode) when there is a draft."""
    from ..decode.modes import default_mode as default_for, get_mode

    return default_for(draft_ref is not None) if mode is None else get_mode(mode).name


def check_spec_policy(policy: str) -> str:
    from ..decode.session import SPEC_POLICIES

    if policy not in SPEC_POLICIES:
        raise OptionValueError(f"unknown --spec-policy {policy!r}; choose one of {', '.join(SPEC_POLICIES)}")
    return policy


def make_job_config(target: ModelRef, draft_ref: ModelRef | None, spec: DraftSpec, job: JobOptions) -> JobConfig:
    """The engine's JobConfig from resolved models and the shared job options (a JobOptions)."""
    from ..decode.sampling import SamplingParams
    from ..planner.job_config import JobConfig
    from ..decode.session import DecodeOptions
    from .console import debug_enabled

    return JobConfig(
        model_path=target.path, model_label=target.label,
        draft_path=None if draft_ref is None else draft_ref.path, draft=spec,
        sampling=SamplingParams(temperature=job.temp, top_k=job.top_k, top_p=job.top_p, min_p=job.min_p, seed=job.seed),
        decode=DecodeOptions(n_predict=job.n_predict, n_draft=job.n_draft, n_min=_draft_min(job), p_min=job.p_min,
                             p_accept=job.p_accept,
                             p_split=job.p_split, p_recovery=job.p_recovery, p_decay=job.p_decay,
                             max_branches=job.max_branches, max_inflight=job.max_inflight, p_reach=job.p_reach,
                             spec_policy=check_spec_policy(job.spec_policy), ubatch=job.ubatch),
        n_ctx=job.ctx, layer_split=job.layer_split, threads=job.threads, debug=debug_enabled(),
        rank_timeout_s=job.rank_timeout, profile=job.profile,
        model_sha256=target.entry.sha256 if target.entry else None, model_size=target.entry.size if target.entry else None,
        draft_sha256=_entry_field(draft_ref, "sha256"), draft_size=_entry_field(draft_ref, "size"),
    )


def _draft_min(job) -> int:
    if job.draft_min > job.n_draft:
        raise OptionValueError(f"--draft-min {job.draft_min} is larger than --n-draft {job.n_draft}; a draft has at most "
                               "--n-draft tokens, so lower --draft-min or raise --n-draft")
    return job.draft_min


def _entry_field(ref: ModelRef | None, name: str) -> str | int | None:
    """A registry fact ("sha256", "size") of a draft ModelRef (None for lookup, no draft, or a path)."""
    entry = ref.entry if ref is not None else None
    return getattr(entry, name) if entry is not None else None


@dataclass(frozen=True)
class PreparedJob:
    """What a job command knows once its options are checked, its models resolved and its job planned."""

    plan: JobPlan  # the job's plan: mode, ranks, layout, settings, -M auto's choice
    target: ModelRef | None = None  # the target's ModelRef (its registry facts: what bench records)
    draft_ref: ModelRef | None = None  # the draft model's ModelRef, None for lookup or no draft

    @property
    def cfg(self) -> JobConfig:
        return self.plan.cfg

    @property
    def mode(self) -> str:
        """The mode asked for, the default one, or -M auto's."""
        return self.plan.mode

    @property
    def ranks(self) -> int:
        return self.plan.ranks

    @property
    def explicit_ranks(self) -> bool:
        """--ranks or --layer-split said how many."""
        return self.plan.explicit_ranks

    @property
    def has_draft(self) -> bool:
        return self.plan.has_draft

    @property
    def auto(self) -> AutoChoice | None:
        """-M auto's choice, when it chose the mode and its settings."""
        return self.plan.auto


@dataclass
class JobStart:
    """A job command after its first steps (begin_job)."""

    prep: PreparedJob
    inside: bool  # this process is a rank of the MPI job, not the command that launches it
    given: object = None  # what begin_job's read_input returned (None where it did not run)


def begin_job(model: str | None, model_opt: str | None, mode: str | None, job,
              read_input: Callable[[bool], object] | None = None, **how) -> JobStart:
    """The steps every job command starts with, in this order: one model, -n checked,
    read_input(inside) (the prompt, say: what a user typed is checked before any model is
    resolved), then the ranks, models, configuration and plan (prepare_job, which takes `how`)."""
    from ..transport.launch import under_mpi_launcher

    model = one_model(model, model_opt)
    check_n_predict(job.n_predict)
    inside = under_mpi_launcher()
    given = read_input(inside) if read_input is not None else None
    return JobStart(prepare_job(model, mode, job, inside, given, **how), inside, given)


def run_here_or_relaunch(prep: PreparedJob, inside: bool, relaunch_job: Callable[[], int]) -> None:
    """The step every job command ends its set-up with. Outside an MPI launcher with several ranks
    (the plan, made from the GGUF header, said a split that cannot work already): run the command
    again under mpiexec (relaunch_job(); this raises typer.Exit with its status). Otherwise this
    process is a rank of the job (or the whole of a 1-rank job): check the world size, and return."""
    if not inside and prep.ranks > 1:
        raise typer.Exit(relaunch_job())
    check_world(prep.ranks, explicit=prep.explicit_ranks)


def one_model(model: str | None, model_opt: str | None) -> str:
    if model is not None and model_opt is not None and model != model_opt:
        raise UsageError(f"two models given: {model!r} and -m {model_opt!r}; give one")
    if (model or model_opt) is None:
        raise UsageError("no model given; pass one, e.g. `pipeinfer generate smollm2-135m-instruct -p Hello` "
                         "(see `pipeinfer models list`)")
    return model or model_opt


def _announce(line: str, inside: bool) -> None:
    """A line of -M auto's (its profile, its choice), once per job: by the command a user typed (not
    again by the job it starts)."""
    import sys

    from ..transport.launch import RELAUNCHED

    if not inside or (not os.environ.get(RELAUNCHED) and launcher_rank() == 0):
        print(line, file=sys.stderr, flush=True)


def prepare_job(model: str, mode: str | None, job, inside: bool, given=None, parallel: int = 1,
                place: bool = True, settings: dict | None = None, drafts: bool | None = None,
                trace_draft: bool = False) -> PreparedJob:
    """Ranks, models (pulled unless inside the MPI job or --no-pull), JobConfig and the job's plan
    (planner/job_plan.make_plan, in one pass). given: the prompt the command read (for -M auto to
    measure prompt lookup's acceptance on); parallel: requests at once (serve --parallel N: -M auto
    and --layer-split auto then keep the split balanced for them); place: --layer-split auto may
    place the draft for the job's mode (bench, which runs every mode on one job, does not);
    settings: the command's own JobConfig fields (serve's load policy, say), set before it plans;
    drafts, trace_draft: whether the job runs its draft (None: where its mode drafts) and whether a
    request records the draft model's chains (planner/job_plan.PlanRequest)."""
    from ..planner.job_plan import PlanRequest, make_plan
    from .auto_mode import AUTO, cluster_facts, hand_down, inherited, with_profile
    from .draft_spec import parse_draft

    want, split_ranks = ranks_wanted(job.ranks, job.layer_split)
    if not inside:
        from ..transport.hostfile import warn_shared_hosts

        warn_shared_hosts(want)
    on_head = not inside or launcher_rank() == 0
    target, draft_ref, spec = resolve_models(model, parse_draft(job.draft), allow_pull=not inside and not job.no_pull,
                                             on_head=on_head)
    from ..decode.modes import check_mode

    check_mode(None if mode == AUTO else mode, bool(spec))
    cfg = replace(make_job_config(target, draft_ref, spec, job),
                  **{**({"parallel": parallel} if parallel > 1 else {}), **(settings or {})})
    say = lambda line: _announce(line, inside)  # noqa: E731
    cfg = with_profile(cfg, model, job, want, mode == AUTO, inside, say)
    request = inherited(PlanRequest(cfg, mode, want, bool(job.ranks or split_ranks), drafts, trace_draft, place), inside)
    plan = make_plan(request, cluster_facts(cfg, job, want, on_head, given), say)
    hand_down(request, plan, inside)
    return PreparedJob(plan, target, draft_ref)
