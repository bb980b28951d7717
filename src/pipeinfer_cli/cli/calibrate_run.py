"""What a calibration runs and what the head does with its profile, shared by `pipeinfer calibrate`
(cli/calibrate_cmd.py) and the quick calibration a running job makes of its own ranks
(cli/auto_profile.py, under the user's own `mpiexec`): the probe's repetitions, the progress
lines, the draft's acceptance and the profile written."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import PipeinferError
from .console import err

if TYPE_CHECKING:
    from ..planner.profile import Profile
    from ..runtime.calibrate_probes import ProbeSpec
    from ..planner.job_config import JobConfig

DRAFT_ACCEPTANCE_TOKENS = {False: 96, True: 32}  # tokens a draft model's acceptance is measured on (by --quick)


def calibrate_in_job(cfg: JobConfig, n_ranks: int, out_path: Path | None, command: str) -> None:
    """A quick calibration of the ranks of the job this process is one of (every rank calls it; a
    job started by the user's own mpiexec, which -M auto or --layer-split auto needs a profile of):
    the head writes the profile to out_path (None on the other ranks), progress on stderr."""
    from ..runtime.calibrate import run_calibration

    profile = run_calibration(replace(cfg, rank_timeout_s=0.0), probe_spec(cfg, True, n_ranks), command, progress)
    if profile is not None:
        save_profile(profile, cfg, True, out_path)


def save_profile(profile: Profile, cfg: JobConfig, quick: bool, out_path: Path) -> None:
    """On the head: the calibration's warnings, the draft's acceptance, the profile written."""
    for line in profile.warnings:
        err.print(f"calibrate: warning: {line}", markup=False, highlight=False)
    if profile.draft is not None and profile.draft.is_model and cfg.draft_path is not None:
        from .draft_acceptance import measure_draft_acceptance

        measure_draft_acceptance(cfg, profile.draft, DRAFT_ACCEPTANCE_TOKENS[quick], lambda line: progress(0, line))
    try:
        profile.save(out_path)
    except OSError as e:
        raise PipeinferError(f"cannot write the profile to {out_path}: {e.strerror or e}") from None


def probe_spec(cfg: JobConfig, quick: bool, n_ranks: int = 1) -> ProbeSpec:
    """What every rank times, and how often (fewer repetitions with --quick). On several ranks each
    timed eval follows a sleep, as a stage's compute follows its wait (calibrate_probes.IDLE_GAP_S).
    Suffix drafting is timed as prompt lookup (`DraftSpec.planned`): both cost no model."""
    from ..runtime.calibrate_probes import IDLE_GAP_S, KV_LENGTHS, PROBE_BYTES, QUICK_KV, QUICK_PROBE_BYTES, ProbeSpec

    return ProbeSpec(str(cfg.model_path or ""), cfg.n_ctx, cfg.decode.n_draft, reps=3 if quick else 7,
                     warmup=1 if quick else 2, overhead_tokens=16 if quick else 48, draft=cfg.draft.planned(),
                     draft_path=str(cfg.draft_path) if cfg.draft_path else None,
                     draft_prompt=128 if quick else 256, draft_proposals=4 if quick else 12,
                     link_reps=50 if quick else 200, kv_points=QUICK_KV if quick else KV_LENGTHS,
                     extra_rows=not quick, prefill_reps=2 if quick else 3, max_reps=6 if quick else 21,
                     prefill_max_reps=4 if quick else 9,
                     idle_gap_s=IDLE_GAP_S if n_ranks > 1 else 0.0,
                     probe_bytes=QUICK_PROBE_BYTES if quick else PROBE_BYTES)


def progress(rank: int | None, line: str) -> None:
    where = "" if rank is None else f"rank {rank}: "
    err.print(f"calibrate: {where}{line}", markup=False, highlight=False)
    sys.stderr.flush()
