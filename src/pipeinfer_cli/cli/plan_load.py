"""`pipeinfer plan --parallel N`: the prediction of N requests at once (planner/load.py), its checks,
its table and its JSON."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import TYPE_CHECKING

from rich import box
from rich.table import Table

from ..decode.parallel_policy import LOAD_POLICIES
from ..errors import OptionValueError, UsageError
from .console import out, print_table
from .wording import plural

if TYPE_CHECKING:
    from ..decode.session import DecodeOptions

MODELLED = ("modelled: N clients sending the prompts in order, each its next one when one ends; the server's "
            "slots (--ctx / N cells each), slot choice, load policy and one draft model lent to one request at a "
            "time; every request's runs interleaved in the stages. Not modelled: HTTP and tokenizing, prefix reuse "
            "between requests, requests queued for a slot, the head's own time per request beside the others")


def check_load(parallel: int, load_policy: str, search: bool, ctx: int, opts: DecodeOptions, has_draft: bool) -> None:
    """--parallel and --load-policy as `serve` takes them: one Error line for what serve would refuse
    (a server loads the draft whenever it has one, so its slots have the sequences drafting needs)."""
    if load_policy not in LOAD_POLICIES:
        raise OptionValueError(f"--load-policy {load_policy!r} is not one of {', '.join(LOAD_POLICIES)}")
    if parallel == 1:
        if load_policy != "yield":
            raise OptionValueError(f"--load-policy {load_policy} applies to parallel requests; give --parallel N "
                                   "(N > 1) too")
        return
    if search:
        raise UsageError("--search looks for the fastest settings of one request at a time; drop --search, or "
                         "--parallel")
    from ..decode.slot_geometry import SlotGeometry
    from .serve_options import check_parallel

    geometry = SlotGeometry.for_job(ctx, parallel, opts.max_inflight, opts.max_branches, drafts=has_draft)
    check_parallel(SimpleNamespace(parallel=parallel, geometry=geometry, n_ctx=ctx, decode=opts))


def split_line(setup, mode: str, parallel: int) -> str | None:
    """With --layer-split auto: the split chosen and the byte-balanced default beside it."""
    if not (setup.layer_split or "").startswith("auto"):
        return None
    from ..planner.job_placement import job_topology

    chosen = setup.topology(mode).describe()
    load = "one request at a time" if parallel == 1 else f"{parallel} requests at once"
    line = f"layers: --layer-split auto, balanced by measured time for {load}: {chosen} (layers per stage"
    if "/" in setup.layer_split:
        return line + ")"  # a draft rank: no default split has one to compare with
    by_bytes = job_topology(setup.path, setup.label, setup.n_ranks, None, setup.draft_path, setup.draft,
                            setup.job_drafts, mode, None, setup.n_ctx)
    return line + f"; the default split, by bytes: {by_bytes.describe()})"


def plan_parallel(prof, setup, modes: list[str], replay, opts: DecodeOptions, ctx: int, parallel: int, load_policy: str,
                  as_json: bool, profile_path) -> None:
    """Predict and print every mode under `parallel` requests at once."""
    from ..planner.load import plan_load

    summary = plan_load(prof, setup.topology, modes, replay, opts, ctx, parallel, load_policy)
    line = split_line(setup, modes[0], parallel)
    if as_json:
        doc = {"model": setup.label, "draft": setup.draft_label, "profile": str(profile_path), "parallel": parallel,
               "load_policy": load_policy, "modes": {m: p.to_json() for m, p in summary.items()}}
        out.print_json(json.dumps(doc))
        return
    t = Table(title=f"predicted: {setup.label}" + (f" + {setup.draft_label}" if setup.draft_label else "")
              + f" on {plural(setup.n_ranks, 'rank')}, {parallel} requests at once (serve --parallel {parallel}, "
              f"--load-policy {load_policy}), {plural(len(replay.prompts), 'prompt')}",
              title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in ("mode", "layers", "tok/s", "vs 1", "TTFT p50/p99 ms", "ITL p50/p99 ms", "busy %"):
        t.add_column(col, justify="left" if col in ("mode", "layers", "busy %") else "right", no_wrap=True,
                     min_width=len(col))
    for m, p in summary.items():
        t.add_row(m, p.settings["layer_split"], _f(p.tok_per_s, 2),
                  "-" if p.vs_one_at_a_time is None else f"{p.vs_one_at_a_time:.2f}x",
                  f"{_f(p.ttft_ms['p50'], 0)}/{_f(p.ttft_ms['p99'], 0)}", f"{_f(p.itl_ms['p50'], 1)}/{_f(p.itl_ms['p99'], 1)}",
                  "/".join(f"{100 * u:.0f}" for u in p.utilisation))
    print_table(t)
    say = lambda text: out.print(text, markup=False, highlight=False)  # noqa: E731
    say(f"tok/s: every request's tokens over the time from the first request to the last token (bench --concurrency "
        f"{parallel}'s aggregate); vs 1: against the same prompts one at a time (serve --parallel 1); TTFT from each "
        "request's sending; ITL: every gap between token arrivals; busy: each stage's share of the time computing")
    if line:
        say(line)
    if len(replay.prompts) < parallel:
        say(f"note: {plural(len(replay.prompts), 'prompt')} for {parallel} clients: at most "
            f"{len(replay.prompts)} requests ran at once (give more prompts: --prompts, --limit)")
    say(MODELLED.replace("N clients", f"{parallel} clients").replace("--ctx / N", f"--ctx / {parallel}") + ".")


def _f(v, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"
