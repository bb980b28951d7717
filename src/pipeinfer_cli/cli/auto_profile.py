"""The profile `-M auto` and `--layer-split auto` use when no --profile is given: calibrated once,
quickly, at the start of the first such job, and kept for the next.

The profile is kept in the cache directory (cache.cache_dir(): PIPEINFER_CACHE, else
$XDG_CACHE_HOME/pipeinfer, else ~/.cache/pipeinfer) under profiles/, one file per

- machine: host name, CPU model, logical CPUs and the CPU this process may use;
- models: the target's and the draft model's identity (sha256), or lookup;
- job shape: ranks, threads per rank (--threads, or the default), ranks per host (the job
  starts every rank on this machine) and --n-draft (the batch sizes measured);

so a job of another shape, another model file or on another machine calibrates its own. The
calibration is `pipeinfer calibrate MODEL --ranks N --quick` (the same command, run as a
subprocess; its progress goes to stderr). Delete the file to measure again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import PipeinferError, UsageError

if TYPE_CHECKING:
    from ..runtime.job_config import JobConfig

PROFILES_DIR = "profiles"


def job_key(cfg: JobConfig, n_ranks: int, threads: str | None, n_draft: int) -> dict:
    """What a cached profile must match: the machine, the models and the job's shape."""
    from ..planner.identity import model_sha256
    from ..runtime.host_facts import host_facts

    host = host_facts()
    draft = cfg.draft_label if cfg.draft_path is None else model_sha256(cfg.draft_path, cfg.draft_sha256, cfg.draft_size)
    return {"machine": {k: getattr(host, k) for k in ("host", "cpu", "cores", "usable_cpus")},
            "model": model_sha256(cfg.model_path, cfg.model_sha256, cfg.model_size), "draft": draft,
            "ranks": n_ranks, "threads": threads or "default", "ranks_per_host": n_ranks, "n_draft": n_draft,
            "hosts": os.environ.get("HYDRA_HOST_FILE")}


def profile_path(cfg: JobConfig, key: dict) -> Path:
    from ..models.cache import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(cfg.model_path).stem)[:60]
    return cache_dir() / PROFILES_DIR / f"{name}-{key['ranks']}r-{digest}.json"


def ensure_profile(cfg: JobConfig, model: str, job, n_ranks: int, why: str, inside: bool, say) -> Path:
    """The cached profile of this job (calibrated now if there is none). why: the option that needs
    it ('-M auto'); say(line): a line on stderr (the launching command's, not every rank's)."""
    key = job_key(cfg, n_ranks, job.threads, job.n_draft)
    path = profile_path(cfg, key)
    if path.is_file():
        say(f"pipeinfer: {why}: reusing profile {path} (calibrated before for this machine, model and job shape; "
            "delete it to measure again, or pass --profile)")
        return path
    command = calibrate_command(model, job, n_ranks, path)
    if inside:  # already a rank of an MPI job: calibrating would start a job inside this one
        raise UsageError(f"{why} needs a profile of these ranks and none is cached for this job; run "
                         f"`mpiexec -n {n_ranks} pipeinfer {_shown(command)}` first (or pass --profile FILE)")
    from ..models.cache import ensure_writable_cache

    ensure_writable_cache()
    path.parent.mkdir(parents=True, exist_ok=True)
    say(f"pipeinfer: {why}: no profile of these ranks yet; calibrating them quickly (`pipeinfer {_shown(command)}`, "
        f"about a minute), kept in {path} for the next job of this shape")
    rc = subprocess.run([sys.executable, "-m", "pipeinfer_cli", *command], stdout=subprocess.DEVNULL).returncode
    if rc != 0 or not path.is_file():
        raise PipeinferError(f"{why}: the quick calibration failed (exit status {rc}); run `pipeinfer "
                             f"{_shown(command)}` to see why, or pass --profile FILE")
    return path


def calibrate_command(model: str, job, n_ranks: int, out: Path) -> list[str]:
    """`calibrate --quick` for the job's models, ranks and threads (its argv after `pipeinfer`)."""
    argv = ["calibrate", model, "--ranks", str(n_ranks), "--quick", "--out", str(out), "--no-pull",
            "--n-draft", str(job.n_draft), "--ctx", str(job.ctx), "--rank-timeout", str(_calibrate_timeout(job.rank_timeout))]
    if job.draft:
        argv += ["--draft", job.draft]
    if job.threads:
        argv += ["--threads", job.threads]
    if job.layer_split and not job.layer_split.startswith("auto"):
        argv += ["--layer-split", job.layer_split]
    return argv


def _shown(argv: list[str]) -> str:
    import shlex

    return shlex.join([a for a in argv if a != "--no-pull"])


def _calibrate_timeout(job_timeout: float) -> float:
    """The job's --rank-timeout, at least calibrate's own default (a measuring rank is silent)."""
    from ..transport.deadlines import CALIBRATE_RANK_TIMEOUT_S

    return job_timeout if job_timeout == 0 else max(job_timeout, CALIBRATE_RANK_TIMEOUT_S)
