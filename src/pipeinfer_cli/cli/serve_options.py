"""What `pipeinfer serve` decides before its job starts, shared by the front (serve_front.py) and
a server started inside a launcher of the user's own (serve_in_job.py): the default split of
--parallel, the slots' checks, and the lines the server prints about its requests and its end."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..decode.result import GenerationResult
from ..errors import OptionValueError
from .console import err
from .generate_cmd import summary_line

if TYPE_CHECKING:
    from ..planner.job_config import JobConfig


def default_split(job, parallel: int, environ=os.environ) -> str | None:
    """The split of `serve --parallel N` (N > 1) on several ranks when --layer-split is not given
    (docs/server.md, "The default split"): the layers balanced by measured time for N requests at
    once (`auto`), since parallel requests go as fast as the slowest stage and the byte-balanced
    split leaves the stage with the LM head short of work. Its profile is --profile, else the quick
    calibration cached for this job's shape, else one made now (as for -M auto). Under a launcher
    of the user's own (mpiexec ... pipeinfer serve, not relaunched by pipeinfer) a calibration
    cannot start inside the job, so there the default is auto only with --profile, else by bytes.

    Sets job.layer_split to "auto" when the rule applies; returns "auto", "bytes" (the rule applies
    but no profile can be had) or None (not a parallel job on several ranks, or a split given)."""
    from ..transport.launch import RELAUNCHED, under_mpi_launcher

    if parallel <= 1 or job.layer_split is not None or (job.ranks or 1) <= 1:
        return None
    if under_mpi_launcher() and not environ.get(RELAUNCHED) and job.profile is None:
        return "bytes"
    job.layer_split = "auto"
    _say(f"--parallel {parallel} on {job.ranks} ranks without --layer-split: the layers go to the stages by "
         f"measured time for {parallel} requests at once (--layer-split auto), not by bytes; give --layer-split "
         "to choose")
    return "auto"


def announce_split(rule: str | None, plan) -> None:
    """Which split default_split's rule gave (the plan's: planner/job_plan.py), beside the
    byte-balanced one (stderr, once per job)."""
    from dataclasses import replace

    from ..planner.job_plan import layout_of
    from ..planner.layout import format_layer_ranges

    if rule is None or not _speaks():
        return
    cfg = plan.cfg
    if rule == "bytes":
        _say(f"--parallel {cfg.parallel} under your MPI launcher without --profile: the layers are split by bytes "
             "(no quick calibration inside a job); pass --profile FILE (`pipeinfer calibrate`) to balance them by "
             "measured time for parallel requests")
        return
    layers = lambda topo: format_layer_ranges([r.layers for r in topo.ranks])  # noqa: E731
    by_bytes = layout_of(replace(cfg, layer_split=None), plan.ranks, 1, plan.drafts)
    _say(f"split for {cfg.parallel} requests at once: layers {layers(plan.layout)} (profile {cfg.profile}); by bytes "
         f"they would be {layers(by_bytes)}")


def _speaks() -> bool:
    """Whether this process says the job's start-up lines: the launching command (or rank 0 under a
    launcher of the user's own), not every rank of the job."""
    from ..transport.launch import RELAUNCHED, under_mpi_launcher
    from ..transport.start_waits import launcher_rank

    return not under_mpi_launcher() or (not os.environ.get(RELAUNCHED) and launcher_rank() == 0)


def _say(text: str) -> None:
    if _speaks():
        err.print(f"pipeinfer serve: {text}", markup=False, highlight=False)


def check_parallel(cfg: JobConfig) -> None:
    """--parallel N needs N slots of at least 256 cells and N shares of the engine's sequence ids."""
    from ..decode.slot_geometry import MAX_SEQUENCES, SLOT_CELL_BLOCK

    n, geometry = cfg.parallel, cfg.geometry
    if n == 1:
        return
    if geometry.cells_per_slot < SLOT_CELL_BLOCK:
        raise OptionValueError(f"--parallel {n} splits --ctx {cfg.n_ctx} into slots of fewer than 256 cells; "
                               f"raise --ctx to at least {256 * n} or lower --parallel")
    per = geometry.seqs_per_slot
    if not geometry.fits:
        most = geometry.max_inflight_fitting(cfg.decode.max_branches)
        raise OptionValueError(f"--parallel {n} needs {per * n} KV sequences ({per} per request: --max-inflight "
                               f"{cfg.decode.max_inflight} x --max-branches {cfg.decode.max_branches} + 2), more "
                               f"than {MAX_SEQUENCES}; lower --parallel to {MAX_SEQUENCES // per}, or --max-inflight "
                               f"to {most}")


def stopped_line(signal_name: str | None) -> str:
    """How a server that was told to stop ends, on one rank or many: a line on stderr, exit status 0
    (a stop signal is how a server is meant to end, not an error)."""
    return "pipeinfer serve: stopped" + (f" by {signal_name}" if signal_name else "")


def _log_request(endpoint: str, result: GenerationResult) -> None:
    line = summary_line(result).removeprefix("pipeinfer: ")
    err.print(f"pipeinfer serve: {endpoint} #{result.prompt_id}: {result.finish_reason}, {line}",
              markup=False, highlight=False)


def print_banner(cfg: JobConfig, ranks: list[str], default_mode: str, max_queue: int, address: str, auto=None) -> None:
    """Printed once the job has loaded, in the manner of llama-server. ranks: runtime/engine.describe_ranks."""
    from .wording import plural

    chosen = "" if auto is None else f" (-M {auto.summary(None)})"
    lines = [f"model {cfg.model_label}, draft {cfg.draft_label or 'none'}, default mode {default_mode}{chosen}, "
             f"context {cfg.n_ctx} cells, queue {max_queue}" +
             (f", {cfg.parallel} slots of {cfg.slot_ctx} cells ({cfg.load_policy})" if cfg.parallel > 1 else ""),
             f"{plural(len(ranks), 'rank')}: {'; '.join(ranks)}",
             f"ready: {address}/v1 (chat/completions, completions, models), /health, /metrics, /slots"]
    for line in lines:
        err.print(f"pipeinfer serve: {line}", markup=False, highlight=False)
