"""`pipeinfer plan`: predict every mode's speed on a calibrated cluster before running it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypedDict

import typer
from rich import box
from rich.table import Table

from ..decode.draft_spec import DraftSpec
from ..decode.modes import MODE_NAMES, get_mode, needs_draft
from ..decode.session import DecodeOptions
from ..errors import UsageError
from .console import err, out, print_table
from ..planner.acceptance import confidences as draft_confidences
from ..planner.search import never_speculated
from .plan_checks import check_job, check_trace
from .options import (JsonFlag, LayerSplitOption, MaxInflightOption, NDraftOption, NPredictOption, PAcceptOption,
                      ThreadsOption)
from .wording import epilog, plural

if TYPE_CHECKING:
    from ..planner.plan import ModeSummary

EPILOG = epilog("""Examples:

  pipeinfer calibrate qwen-coder --ranks 2 --out cluster.json

  pipeinfer plan qwen-coder --profile cluster.json --prompts default \\
      --limit 4

  pipeinfer plan qwen-coder --profile cluster.json -p "def fib(n):" \\
      --record fib.trace

  pipeinfer plan qwen-coder --profile cluster.json --trace fib.trace \\
      --search

  pipeinfer plan qwen-coder --profile cluster.json -p "def fib(n):" \\
      --record fib.trace --record-ranks 2

  pipeinfer generate qwen-coder --ranks 2 -M speculative -p "def fib(n):" \\
      --save-trace fib.trace

  pipeinfer plan qwen-coder --profile cluster.json --trace fib.trace \\
      --layer-split auto

  pipeinfer plan qwen2.5-coder-0.5b-instruct --profile cluster.json \\
      --prompts default --limit 8 --parallel 2 --layer-split auto

How it predicts: the decoding policies that `generate` runs (the same code) run in virtual time
against a simulated pipeline built from the profile: each stage busy for its measured seconds per
layer at the run's rows and KV length, hidden states crossing each link as latency plus bytes over
bandwidth, cancels that skip a run or stop it at the next layer, the head's own layers and
drafting in the head's time. Acceptance is replayed: the target's tokens for each prompt and the
draft's greedy chain from every committed prefix are recorded once (a trace), so every mode meets
exactly the draft it would meet in a run. A trace comes from this machine (--record: one process
with the whole target; --record-ranks N: an MPI job with the layers split), or from a real job
(`generate`/`bench --save-trace FILE`, on any ranks and hosts). --acceptance RATE replaces the draft by one that is right
with that probability (sweeps, or a draft model that is not here).

--parallel N predicts `serve --parallel N` under N clients that each send their next prompt when
one ends (`bench --concurrency N`): the server's own slot choice, load policy and draft lending
run the N requests on one simulated pipeline, each in its slot of --ctx / N cells, their runs
interleaved in the stages. It prints the aggregate tok/s (against the same prompts one at a time),
TTFT and ITL p50/p99 per mode; with --layer-split auto, the split balanced for N requests at once
(what `serve --parallel N` runs by default on several ranks). Not modelled: HTTP and tokenizing,
prefix reuse between requests, requests queued for a slot, the head's own time per request beside
the others.
""")

ProfileOption = Annotated[Path, typer.Option("--profile", help="The profile `pipeinfer calibrate` wrote.")]
TraceOption = Annotated[Path | None, typer.Option("--trace", help="A trace recorded before (--record): no model runs.")]
RecordOption = Annotated[Path | None, typer.Option("--record", help="Record the trace (target tokens and draft chains) and save it here.")]
PromptsOption = Annotated[str | None, typer.Option("--prompts", help="A shipped prompt set ('default', 'grounded') or a JSONL file, as `bench` takes it.")]
LimitOption = Annotated[int | None, typer.Option("--limit", min=1, help="Use only the first N prompts.")]
ModesOption = Annotated[str | None, typer.Option("--modes", show_default=False, help="Comma-separated modes to predict (default: every mode with a draft, else iterative).")]
AcceptanceOption = Annotated[float | None, typer.Option("--acceptance", min=0.0, max=1.0, help="A synthetic draft, right with this probability per token (no draft chains needed).")]
SearchFlag = Annotated[bool, typer.Option("--search", help="Also search the fastest predicted settings per mode (speculative: n_draft; pipeinfer: n_draft, p_accept and max_inflight), each on the split `generate -M MODE` uses.")]
ForceFlag = Annotated[bool, typer.Option("--force", help="Plan even when the profile or the trace was made for another job (model file, threads, ranks per host, machine): one warning line instead of the error.")]
RecordRanksOption = Annotated[int | None, typer.Option("--record-ranks", min=1, show_default=False, help="Record the trace as an MPI job of N ranks, the target's layers split across them (`pipeinfer generate`/`bench --save-trace`, started as `--ranks N` starts them), instead of one process holding the whole target; with --layer-split, --threads and --ctx as given.")]
PlanRanksOption = Annotated[int | None, typer.Option("--ranks", "-r", min=1, help="Ranks to plan for (default: the profile's).")]
ParallelOption = Annotated[int, typer.Option("--parallel", "-np", min=1, max=32, help="Requests at once, as `serve --parallel N` serves N clients that each send their next prompt when one ends: aggregate tok/s, TTFT and ITL p50/p99 per mode (1: each prompt alone).")]
PlanLoadPolicyOption = Annotated[str, typer.Option("--load-policy", metavar="yield|round-robin|no-spec", help="With --parallel: when a request may speculate beside others, as `serve --load-policy`.")]


def plan(
    model: Annotated[str, typer.Argument(help="Target model: registry name, pair name (target + draft), or .gguf path.")],
    profile: ProfileOption = Path("profile.json"),
    draft: Annotated[str | None, typer.Option("--draft", "-md", help="Draft model (name or .gguf path), or 'lookup'.")] = None,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="Raw prompt text.")] = None,
    prompts: PromptsOption = None,
    limit: LimitOption = None,
    trace: TraceOption = None,
    record: RecordOption = None,
    record_ranks: RecordRanksOption = None,
    acceptance: AcceptanceOption = None,
    n_predict: NPredictOption = 128,
    modes: ModesOption = None,
    ranks: PlanRanksOption = None,
    layer_split: LayerSplitOption = None,
    n_draft: NDraftOption = 4,
    p_accept: PAcceptOption = 0.5,
    max_inflight: MaxInflightOption = 4,
    search: SearchFlag = False,
    parallel: ParallelOption = 1,
    load_policy: PlanLoadPolicyOption = "yield",
    ctx: Annotated[int, typer.Option("--ctx", "-c", min=16, help="Context size (KV cells), as the job would use.")] = 4096,
    threads: ThreadsOption = None,
    force: ForceFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """Predict tok/s, TTFT and inter-token latency of each mode on the cluster a profile describes.

    The table goes to stdout (--json: one object, with the fields of `generate --json` per mode and
    prompt), progress to stderr. Nothing runs on the cluster: a trace is recorded on this machine
    (one process, the whole target; --record-ranks N: an MPI job of N ranks) unless --trace gives
    one (`--record`, or `generate`/`bench --save-trace` on the cluster).
    """
    from ..planner.plan import Replay, plan_modes
    from ..planner.profile import Profile
    from .plan_load import check_load, plan_parallel

    opts = DecodeOptions(n_predict=n_predict, n_draft=n_draft, p_accept=p_accept, max_inflight=max_inflight)
    prof = Profile.load(profile)
    setup = _setup(model, draft, prof, profile, ranks, layer_split, ctx)
    check_load(parallel, load_policy, search, ctx, opts, bool(setup.draft))
    setup.load = (parallel, load_policy)
    mode_list = _modes(modes, setup.draft, prof)
    setup.job_drafts = any(needs_draft(m) for m in mode_list)
    check_job(setup, mode_list, threads, force, _warn)
    setup.force = force
    job = {"ranks": record_ranks, "layer_split": layer_split, "threads": threads, "ctx": ctx}
    traced = _trace(setup, prof, prompt, prompts, limit, trace, record, acceptance, n_predict, mode_list, job)
    replay = Replay(traced, acceptance, confidences=None if acceptance is None else
                    draft_confidences(setup.draft, prof.draft, traced))
    if parallel > 1:
        plan_parallel(prof, setup, mode_list, replay, opts, ctx, parallel, load_policy, as_json, profile)
        return
    summary = plan_modes(prof, setup.topology, mode_list, replay, opts, ctx)
    for m, s in summary.items():
        s.note = never_speculated(m, s, setup.topology(m).draft)
    choice = _search(prof, setup, mode_list, replay, opts, ctx, summary, threads) if search else None
    _emit(summary, setup, choice, profile, as_json, mode_list[0])


def _emit(summary: dict[str, ModeSummary], setup: _Setup, choice: PlanChoice | None, profile: Path, as_json: bool,
          first_mode: str) -> None:
    """The plan of one request at a time: --json's object, or the table (and the split auto chose)."""
    from .plan_load import split_line

    if as_json:
        out.print_json(json.dumps({"model": setup.label, "draft": setup.draft_label, "profile": str(profile),
                                   "modes": {m: s.as_dict() for m, s in summary.items()},
                                   **({"choice": choice} if choice else {})}))
        return
    _print_table(summary, setup, choice)
    if (line := split_line(setup, first_mode, 1)) is not None:
        out.print(line, markup=False, highlight=False)


class PlanChoice(TypedDict, total=False):
    """`plan --search`'s fastest mode and its settings (--json's "choice"): the settings its mode has,
    and with --layer-split auto where the draft runs and the threads (-M auto's placement)."""

    mode: str
    n_draft: int
    p_accept: float
    max_inflight: int
    layer_split: str
    threads: str
    placement: str
    tok_per_s: float | None


def _search(prof, setup, mode_list: list[str], replay, opts: DecodeOptions, ctx: int,
            summary: dict[str, ModeSummary], threads: str | None = None) -> PlanChoice:
    """The planner's search (the one -M auto runs): each mode's best settings into `summary`, and the
    fastest mode with its settings, each mode on the split `generate -M MODE` would use; with
    --layer-split auto, also where the draft runs and the threads (-M auto's placements)."""
    from ..planner.search import choose
    from ..planner.job_placement import placement_search

    c = choose(prof, lambda m: setup.topology(m, needs_draft(m)), mode_list, replay, opts, ctx,
               on_step=lambda m, i, n: _progress(f"search {m}", i, n),
               placements_of=placement_search(setup, prof, opts, threads, replay))
    for m, b in c.per_mode.items():
        summary[m].best = {**_knobs(m, b.opts), "layer_split": b.summary.settings["layer_split"],
                           "tok_per_s": b.tok_per_s, "note": b.note, **_placed(b)}
    split = c.per_mode[c.mode].summary.settings["layer_split"]
    return PlanChoice(mode=c.mode, **_knobs(c.mode, c.opts), **{"layer_split": split, **_placed(c.per_mode[c.mode])},
                      tok_per_s=c.tok_per_s)


def _placed(best) -> dict[str, str]:
    from ..planner.job_placement import placement_note

    p = best.placement
    return {} if p is None else {"layer_split": p.layer_split(), "threads": p.threads_option(),
                                 "placement": placement_note(best)}


def _knobs(mode: str, o: DecodeOptions) -> dict[str, float]:
    """The settings the search tries for a mode: none for iterative, n_draft for speculative, all three
    for pipeinfer (planner/search.candidate_options)."""
    if not needs_draft(mode):
        return {}
    if mode != "pipeinfer":
        return {"n_draft": o.n_draft}
    return {"n_draft": o.n_draft, "p_accept": o.p_accept, "max_inflight": o.max_inflight}


def _knob_text(knobs: dict[str, float]) -> str:
    return ", ".join(f"{k} {v}" for k, v in knobs.items())


class _Setup:
    """The target, draft and topology a plan is for."""

    def __init__(self, label, path, draft: DraftSpec, draft_path, n_ranks, layer_split, profile, profile_path, n_ctx):
        self.label, self.path, self.draft, self.draft_path = label, path, draft, draft_path
        self.n_ranks, self.layer_split, self.profile, self.profile_path = n_ranks, layer_split, profile, profile_path
        self.n_ctx = n_ctx
        self.job_drafts = False  # some planned mode needs the draft (set once the modes are known)
        self.sha256 = self.draft_sha256 = None  # the files' identities (set by _setup)
        self.force = False
        self.load = (1, "yield")  # --parallel and --load-policy, which --layer-split auto balances for

    @property
    def draft_label(self) -> str | None:
        return self.draft.label

    def topology(self, mode: str, job_drafts: bool | None = None):
        """The split of the job that runs the planned modes, as `bench` plans one job for them all:
        a draft model on the head takes layers from it if any planned mode drafts (with one mode,
        the split `generate -M MODE` uses). job_drafts: whether it does, instead."""
        from ..planner.job_placement import job_topology

        return job_topology(self.path, self.label, self.n_ranks, self.layer_split, self.draft_path, self.draft,
                            self.job_drafts if job_drafts is None else job_drafts, mode, self.profile_path,
                            self.n_ctx, self.load)


def _setup(model: str, draft: str | None, prof, profile_path: Path, ranks: int | None, layer_split: str | None,
           n_ctx: int) -> _Setup:
    from ..planner.identity import model_sha256
    from .job_setup import ranks_wanted, resolve_models

    from .draft_spec import parse_draft

    target, draft_ref, spec = resolve_models(model, parse_draft(draft), allow_pull=False)
    if spec.uses_suffix:
        raise UsageError(f"plan predicts prompt lookup, not suffix drafting, whose acceptance depends on the "
                         f"job's earlier requests (--draft {spec.label}); plan --draft lookup for its floor")
    if spec.is_hybrid:
        raise UsageError(f"plan predicts a draft model or prompt lookup, not both (--draft {spec.label}); "
                         f"plan --draft {spec.model} or --draft lookup")
    prof.check_model(target.label, target.path.stat().st_size, "the profile")
    want, split_ranks = ranks_wanted(ranks, layer_split)
    n = want if (ranks or split_ranks) else len(prof.ranks)
    if n > len(prof.ranks):
        raise UsageError(f"the plan has {plural(n, 'rank')} but the profile measured {plural(len(prof.ranks), 'rank')}; "
                         f"calibrate with --ranks {n}")
    draft_path = None if draft_ref is None else draft_ref.path
    setup = _Setup(target.label, target.path, spec, draft_path, n, layer_split, prof, profile_path, n_ctx)
    setup.sha256 = model_sha256(target.path, *_registry(target))
    if draft_path is not None:
        setup.draft_sha256 = model_sha256(draft_path, *_registry(draft_ref))
    return setup


def _registry(ref) -> tuple:
    entry = getattr(ref, "entry", None)
    return (entry.sha256, entry.size) if entry is not None else (None, None)


def _warn(text: str) -> None:
    err.print(f"pipeinfer plan: {text}", markup=False, highlight=False)


def _modes(text: str | None, draft: DraftSpec, prof) -> list[str]:
    """The modes to plan: those asked for, each checked against the draft and the profile's costs."""
    if text is None:
        return list(MODE_NAMES) if draft else ["iterative"]
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise UsageError("--modes is empty; give one or more of " + ", ".join(MODE_NAMES))
    modes = [get_mode(m, "--modes").name for m in names]
    drafting = [m for m in modes if needs_draft(m)]
    if drafting and draft.is_none:
        raise UsageError(f"--modes {','.join(drafting)} needs a draft: pass --draft MODEL (or lookup)")
    if drafting and draft.uses_model and (prof.draft is None or not prof.draft.is_model):
        raise UsageError(f"the profile has no draft model's costs for --modes {','.join(drafting)}: calibrate with "
                         f"--draft {draft.label}")
    return modes


def _progress(what: str, i: int, n: int) -> None:
    if i == n or i % max(1, n // 10) == 0:
        err.print(f"pipeinfer plan: {what}: {i}/{n}", markup=False, highlight=False)


def _trace(setup: _Setup, prof, prompt, prompts, limit, trace, record, acceptance, n_predict, modes, job) -> list:
    from ..planner.replay import Trace

    with_chains = acceptance is None and setup.draft.uses_model and any(needs_draft(m) for m in modes)
    if trace is not None:
        if prompt or prompts or job["ranks"]:
            raise UsageError("--trace already holds its prompts; drop -p/--prompts/--record-ranks, or record a new "
                             "trace with --record")
        t = Trace.load(trace)
        if t.model.get("file_bytes") != setup.path.stat().st_size:
            raise UsageError(f"the trace {trace} was recorded with {t.model.get('name')}, not {setup.label}; "
                             "record one with this model (--record)")
        check_trace(t, trace, setup, setup.force, _warn)
        if with_chains and not t.depth:
            raise UsageError(f"the trace {trace} holds no draft model's chains (recorded without one, or with lookup): "
                             f"record it with --draft {setup.draft_label}, or pass --acceptance RATE")
        return t.prompts[:limit] if limit else t.prompts
    from .plan_record import record_on_job, record_trace

    if job["ranks"]:
        t = record_on_job(setup, prompt, prompts, limit, n_predict, with_chains, job["ranks"], job)
    else:
        t = record_trace(setup, prompt, prompts, limit, n_predict, with_chains)
    if record is not None:
        t.save(record)
        err.print(f"pipeinfer plan: trace written to {record}", markup=False, highlight=False)
    return t.prompts


def _print_table(summary: dict[str, ModeSummary], setup: _Setup, choice: PlanChoice | None) -> None:
    t = Table(title=f"predicted: {setup.label}" + (f" + {setup.draft_label}" if setup.draft_label else "")
              + f" on {plural(setup.n_ranks, 'rank')}", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
              pad_edge=False)
    for col in ("mode", "layers", "tok/s", "decode", "TTFT s", "ITL ms", "accept", "speedup", "busy %"):
        t.add_column(col, justify="left" if col in ("mode", "layers", "busy %") else "right", no_wrap=True,
                     min_width=len(col))
    for m, s in summary.items():
        acc = s.acceptance["rate"]
        vs = (s.speedup or {}).get("vs_iterative")
        t.add_row(m + (" *" if s.note else ""), s.settings["layer_split"], _f(s.tok_per_s, 2),
                  _f(s.decode_tok_per_s, 2), _f(s.ttft_s, 3), _f(s.itl_ms["p50"], 1),
                  ("-" if s.note is None else "none") if acc is None else f"{acc:.0%}",
                  "-" if vs is None else f"{vs:.2f}x", "/".join(f"{100 * u:.0f}" for u in s.utilisation))
    print_table(t)
    say = lambda text: out.print(text, markup=False, highlight=False)  # noqa: E731
    say("decode: tok/s after the first token; ITL: median gap between token arrivals; speedup: against "
        "iterative (geometric mean over prompts); busy: each stage's share of the time computing")
    for m, s in summary.items():
        if s.note:
            say(f"* {m}: {s.note}")
        if s.best is not None:
            say(_best_line(m, s))
        if s.draft_misses:
            say(f"note: {m}: the trace could not answer {s.draft_misses} draft questions (beyond its "
                "recorded depth); those drafts were cut short")
    if choice is not None:
        knobs = _knob_text({k: v for k, v in choice.items() if k in ("n_draft", "p_accept", "max_inflight")})
        split = "" if choice["layer_split"] == summary[choice["mode"]].settings["layer_split"] else \
            f", layers {choice['layer_split']}"
        say(f"fastest: {choice['mode']}" + (f" ({knobs}{split})" if knobs else f" ({split[2:]})" if split else "")
            + f" -> {_f(choice['tok_per_s'], 2)} tok/s (what -M auto chooses for this profile, draft and acceptance)")


def _best_line(mode: str, s: ModeSummary) -> str:
    """The search's best settings of one mode. The search runs each mode on the split `generate -M
    MODE` uses, which differs from the table's when a draft model on the head takes layers from it
    in a job that drafts: then the line names that split, and its figure is that split's."""
    b = s.best
    knobs = _knob_text({k: v for k, v in b.items() if k in ("n_draft", "p_accept", "max_inflight")})
    other = b["layer_split"] != s.settings["layer_split"]
    if "placement" in b:  # --layer-split auto: the search placed the draft and chose the threads
        where = f"--layer-split {b['layer_split']} --threads {b['threads']} ({b['placement']})"
    else:
        where = f"layers {b['layer_split']} (the split of `generate -M {mode}`)" if other else ""
    what = ", ".join(x for x in (knobs, where) if x) or "no settings to search (the table's row)"
    return (f"best {mode}: {what} -> {_f(b['tok_per_s'], 2)} tok/s"
            + (f" ({b['note']})" if b["note"] and not s.note else ""))


def _f(v, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"
