"""`-M auto`: the mode and settings the plan predicts fastest for this job's ranks and draft.

The search is the planner's (planner/search.py: the one `plan --search` runs), on the profile of
these ranks (--profile, else one calibrated quickly and cached: cli/auto_profile.py), for the
request the job will run, with the draft's acceptance measured where it can be
(planner/acceptance.py: on the prompt itself for lookup; by `calibrate --draft` for a model) and
assumed (DEFAULT_ACCEPTANCE) where not. The job says what it chose, and on what acceptance, on
stderr when it starts, and `generate`'s summary line sets the predicted speed beside the measured
one. Every process of the job makes the same choice (the simulation is deterministic), so no
message is needed. Between requests (chat turns), Replanner plans the settings again, for the
same mode, when the acceptance measured so far leaves the one planned on by a margin
(planner/replan.py); never inside a request.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..decode.draft_spec import LOOKUP
from ..errors import UsageError
from ..planner.acceptance import DEFAULT_ACCEPTANCE, Acceptance

if TYPE_CHECKING:
    from ..decode.session import DecodeOptions
    from ..runtime.job_config import JobConfig

AUTO = "auto"


@dataclass
class AutoChoice:
    mode: str
    decode: DecodeOptions
    predicted_tok_per_s: float | None
    acceptance: Acceptance  # what the draft was planned to get right, and how that was obtained
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
        on = "" if self.acceptance.rate is None else f", on {self.acceptance.describe()}"
        return f"pipeinfer: -M {self.describe()}{on}, run with the profile's --threads {self.threads}"

    def to_json(self) -> dict:
        """The choice (generate --json's "auto"; CHOICE_ENV carries it to the job's ranks)."""
        a, d = self.acceptance, self.decode
        return {"mode": self.mode, "n_draft": d.n_draft, "p_accept": d.p_accept, "max_inflight": d.max_inflight,
                "predicted_tok_per_s": self.predicted_tok_per_s, "threads": self.threads,
                "acceptance": {"rate": a.rate, "measured": a.measured, "source": a.source}}

    def summary(self, measured_tok_per_s: float | None) -> str:
        """For generate's summary line: the choice, its acceptance, and predicted against measured speed."""
        how = "measured" if self.acceptance.measured else "assumed"
        speed = "" if measured_tok_per_s is None else f" against {measured_tok_per_s:.2f} measured"
        if self.acceptance.rate is None:
            return f"{self.describe()}{speed}"
        return f"{self.describe()}{speed} (planned on acceptance {how} {self.acceptance.rate:.0%})"


def choose(cfg: JobConfig, n_ranks: int, has_draft: bool, prompt_tokens: list[int] | None = None) -> AutoChoice:
    """The fastest predicted mode and settings for this job (cfg: a JobConfig with a profile).
    prompt_tokens: the request's prompt, when the job knows it before it starts (generate)."""
    from ..decode.modes import MODE_NAMES, needs_draft
    from ..planner import search
    from ..planner.identity import model_sha256
    from ..planner.plan import Replay
    from ..planner.profile import Profile

    if cfg.profile is None:
        raise UsageError("-M auto needs a profile of the ranks: run `pipeinfer calibrate MODEL --ranks N --out "
                         "profile.json` (with the draft), then pass --profile profile.json")
    prof = Profile.load(cfg.profile)
    prof.check_model(cfg.model_label, cfg.model_path.stat().st_size, f"the profile {cfg.profile}",
                     model_sha256(cfg.model_path, cfg.model_sha256, cfg.model_size))
    if len(prof.ranks) < n_ranks:
        raise UsageError(f"-M auto: the profile measured {len(prof.ranks)} rank(s) but the job has {n_ranks}; "
                         "calibrate with as many ranks as the job runs")
    threads = job_threads(prof, cfg, n_ranks)
    lookup = cfg.draft.is_free  # suffix drafting is planned as prompt lookup (DraftSpec.planned)
    modes = [m for m in MODE_NAMES if not needs_draft(m) or (has_draft and (lookup or _has_model_costs(prof)))]
    acceptance = draft_acceptance(cfg, prof, prompt_tokens)
    n_gen = cfg.decode.n_predict if 0 < cfg.decode.n_predict < search.AUTO_GEN else search.AUTO_GEN
    rate = DEFAULT_ACCEPTANCE if acceptance.rate is None else acceptance.rate  # no draft: no mode drafts
    replay = Replay([search.auto_request(prompt_tokens, n_gen)], rate, confidences=acceptance.confidences)

    def topo_of(mode: str):
        return job_topology(cfg.model_path, cfg.model_label, n_ranks, cfg.layer_split, cfg.draft_path, cfg.draft,
                            needs_draft(mode), mode, cfg.profile, cfg.n_ctx)

    c = search.choose(prof, topo_of, modes, replay, cfg.decode, cfg.n_ctx)
    return AutoChoice(c.mode, c.opts, c.tok_per_s, acceptance, threads)


def _has_model_costs(prof) -> bool:
    return prof.draft is not None and prof.draft.kind == "model"


def draft_acceptance(cfg: JobConfig, prof, prompt_tokens: list[int] | None) -> Acceptance:
    """The acceptance -M auto plans with: measured where it can be (the module doc), else assumed."""
    from ..planner.acceptance import assumed, from_profile, lookup_on_prompt

    if not cfg.draft:
        return Acceptance(None, False, "no draft")
    if cfg.draft.is_free:  # suffix drafting too: prompt lookup's acceptance is its floor
        if prompt_tokens:
            return lookup_on_prompt(prompt_tokens)
        return assumed("prompt lookup, before any prompt is known")
    return from_profile(prof.draft) or assumed("the profile's calibration did not measure the draft's acceptance")


def job_topology(model_path, model_label: str, n_ranks: int, layer_split, draft_path, draft, job_drafts: bool,
                 mode: str, profile_path, n_ctx: int, load: tuple[int, str] = (1, "yield")):
    """The planner's Topology of the job that runs `mode` (job_drafts: a draft model on the head takes
    layers from it), as `plan` and `-M auto` both plan it; load: requests at once and the load
    policy (serve --parallel N --load-policy P), which --layer-split auto balances the stages for."""
    from ..decode.modes import needs_draft
    from ..planner.predict import Topology
    from ..runtime.topology import plan_job

    t = plan_job(model_path, model_label, n_ranks, n_ranks, layer_split, None, draft_path, job_drafts,
                 has_draft=bool(draft), profile_path=profile_path, n_ctx=n_ctx, identity_checked=True,
                 load=load)
    stages = [r for r in t.ranks if r.role != "draft"]
    if needs_draft(mode):
        where = LOOKUP if draft.is_free else (t.draft_rank if t.draft_rank is not None else "head")
        return Topology([r.rank for r in stages], [r.layers for r in stages], where)
    return Topology([r.rank for r in stages], [r.layers for r in stages], None)


def job_threads(prof, cfg: JobConfig, n_ranks: int) -> str:
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


# The launching command's decisions, inherited by the ranks of the job it starts, which take them
# instead of deciding again (a rank does not have the prompt; every rank must run the same settings).
CHOICE_ENV = "PIPEINFER_AUTO_CHOICE"


def resolve(cfg: JobConfig, model: str, job, n_ranks: int, auto: bool, inside: bool, on_head: bool, given,
            say) -> tuple[JobConfig, AutoChoice | None]:
    """Before a job starts: the profile that -M auto and --layer-split auto need (given, cached, or
    calibrated now), then -M auto's choice (None without -M auto). Returns the job's configuration
    with that profile, and the choice. given: the prompt (PromptInput), known to the launching
    command of `generate`; say(line): stderr, once per job."""
    import os

    import json

    split_auto = bool(cfg.layer_split) and cfg.layer_split.startswith("auto")
    if cfg.profile is None and (auto or split_auto) and cfg.model_path is not None:
        from .auto_profile import ensure_profile
        from .options import PROFILE_ENV

        why = "-M auto" if auto else "--layer-split auto"
        cfg = replace(cfg, profile=ensure_profile(cfg, model, job, n_ranks, why, inside, say))
        if not inside:
            os.environ[PROFILE_ENV] = str(cfg.profile)  # the ranks of the job started next: their --profile
    if not auto:
        return cfg, None
    if os.environ.get(CHOICE_ENV) and inside:
        return cfg, from_env(os.environ[CHOICE_ENV], cfg.decode)
    from pathlib import Path

    if cfg.model_path is None or cfg.profile is None or not (on_head or Path(cfg.profile).is_file()):
        return cfg, None  # a rank without the model or the profile: it takes the head's choice
    tokens = prompt_tokens(cfg, given) if not inside and cfg.draft.is_free else None
    choice = choose(cfg, n_ranks, bool(cfg.draft), tokens)
    if not inside:
        os.environ[CHOICE_ENV] = json.dumps(choice.to_json())
    return cfg, choice


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


def from_env(text: str, decode: DecodeOptions) -> AutoChoice:
    """The launching command's choice (CHOICE_ENV) for a job with the same options (decode: the job's)."""
    import json
    from dataclasses import replace

    d = json.loads(text)
    a = d["acceptance"]
    opts = replace(decode, n_draft=d["n_draft"], p_accept=d["p_accept"], max_inflight=d["max_inflight"])
    return AutoChoice(d["mode"], opts, d["predicted_tok_per_s"], Acceptance(a["rate"], a["measured"], a["source"]),
                      d["threads"])


def replan_settings(cfg: JobConfig, mode: str, n_ranks: int, rate: float,
                    max_inflight_cap: int | None = None) -> tuple[DecodeOptions, float | None]:
    """The planner's best settings for `mode` (the job's: its ranks were started for it) at `rate`;
    max_inflight_cap: the runs in flight the started job's KV sequences hold (search.candidate_options)."""
    from ..decode.modes import needs_draft
    from ..planner import search
    from ..planner.plan import Replay
    from ..planner.profile import Profile

    prof = Profile.load(cfg.profile)
    n_gen = cfg.decode.n_predict if 0 < cfg.decode.n_predict < search.AUTO_GEN else search.AUTO_GEN
    topo = job_topology(cfg.model_path, cfg.model_label, n_ranks, cfg.layer_split, cfg.draft_path, cfg.draft,
                        needs_draft(mode), mode, cfg.profile, cfg.n_ctx)
    best = search.search_settings(prof, topo, mode, Replay([search.auto_request(None, n_gen)], rate), cfg.decode,
                                  cfg.n_ctx, max_inflight_cap=max_inflight_cap)
    return best.opts, best.tok_per_s


class Replanner:
    """-M auto between the requests of a job: the settings the next request runs with (decode),
    planned again when the measured acceptance leaves the planned one (planner/replan.py)."""

    def __init__(self, cfg: JobConfig, choice: AutoChoice, n_ranks: int, say) -> None:
        from ..planner.replan import MeasuredAcceptance

        self.cfg, self.choice, self.n_ranks, self.say = cfg, choice, n_ranks, say
        self.decode = choice.decode
        self._lock = threading.Lock()  # serve: one re-count at a time (after_in_background)
        rate = choice.acceptance.rate
        self.measured = MeasuredAcceptance(DEFAULT_ACCEPTANCE if rate is None else rate)

    def after_in_background(self, drafted: int, accepted: int) -> None:
        """serve: count a finished request; plan again on a thread of its own, so that the pipeline
        goes on with the current settings meanwhile (requests are counted in the order they end)."""
        def count() -> None:
            with self._lock:
                self.after(drafted, accepted)

        threading.Thread(target=count, daemon=True, name="pipeinfer-replan").start()

    def after(self, drafted: int, accepted: int) -> None:
        """Count a finished request's acceptance; plan again (and say so) when it left the plan's."""
        from ..decode.modes import needs_draft

        self.measured.add(drafted, accepted)
        if not needs_draft(self.choice.mode) or not self.measured.should_replan():
            return
        m = self.measured
        before = m.planned
        # The job's KV sequences were opened for the first choice's runs in flight: no more fit.
        self.decode, speed = replan_settings(self.cfg, self.choice.mode, self.n_ranks, m.rate,
                                             max_inflight_cap=self.choice.decode.max_inflight)
        m.replanned()
        d = self.decode
        knobs = f"--n-draft {d.n_draft}" + (f" -pa {d.p_accept} --max-inflight {d.max_inflight}"
                                            if self.choice.mode == "pipeinfer" else "")
        pred = "" if speed is None else f" (predicted {speed:.2f} tok/s)"
        self.say(f"pipeinfer: -M auto: measured acceptance {m.rate:.2f} over {m.drafted} drafted tokens "
                 f"(assumed {before:.2f}): re-planned {knobs}{pred}")


def hindsight(cfg: JobConfig, choice: AutoChoice, n_ranks: int, drafted: int, accepted: int) -> str | None:
    """After generate's one request: when its acceptance left the one planned on by the margin
    (planner/replan.py), what the plan at the measured rate would have chosen; else None."""
    from ..decode.modes import needs_draft
    from ..planner.replan import MeasuredAcceptance

    planned = DEFAULT_ACCEPTANCE if choice.acceptance.rate is None else choice.acceptance.rate
    m = MeasuredAcceptance(planned)
    m.add(drafted, accepted)
    if not needs_draft(choice.mode) or not m.should_replan() or cfg.profile is None:
        return None
    d, speed = replan_settings(cfg, choice.mode, n_ranks, m.rate)
    pred = "" if speed is None else f", predicted {speed:.2f} tok/s"
    return (f"pipeinfer: -M auto: measured acceptance {m.rate:.2f} over {drafted} drafted tokens (planned on "
            f"{planned:.2f}): at that rate the plan picks n_draft {d.n_draft}, p_accept {d.p_accept}, max_inflight "
            f"{d.max_inflight}{pred}; `pipeinfer calibrate --draft` measures a draft's acceptance ahead")
