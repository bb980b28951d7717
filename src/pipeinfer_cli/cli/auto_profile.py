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
subprocess; its progress goes to stderr). A Ctrl-C or SIGTERM that stops the job command during it
stops the calibration's MPI job too (every process, its shared memory), and the command ends with
one `Error:` line once that is done. Delete the file to measure again.

A job started by the user's own launcher (`mpiexec -n 3 pipeinfer generate … -M auto`, no
--ranks) cannot start a calibration job of its own: its ranks are the ones to measure, and they
are running. So they calibrate in place: the head says whether it has a cached profile of this
job (a start-up check-in, transport/startup.py, so a rank that fails first is reported as in any
job), and if not, every rank runs the quick calibration's measuring code (runtime/calibrate.py)
right there, the head writes the profile to the same cache file, and the job goes on with it.

Profiles of the same job at other thread counts (`--threads T`, cached the same way) are what
-M auto takes for those thread counts instead of extrapolating (`measured_profiles`).
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

from ..errors import PipeinferError

if TYPE_CHECKING:
    from ..planner.job_config import JobConfig
    from ..planner.profile import Profile

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


def ensure_profile(cfg: JobConfig, model: str, job, n_ranks: int, why: str, inside: bool, say) -> Path | None:
    """The cached profile of this job (calibrated now if there is none). why: the option that needs
    it ('-M auto'); say(line): a line on stderr (the launching command's, not every rank's).
    inside: this process is a rank of the job (the user's own launcher): calibrated in place, every
    rank taking part; None on a rank other than the head (it takes the head's plan)."""
    if inside:
        return _in_this_job(cfg, model, job, n_ranks, why, say)
    key = job_key(cfg, n_ranks, job.threads, job.n_draft)
    path = profile_path(cfg, key)
    if path.is_file():
        say(f"pipeinfer: {why}: reusing profile {path} (calibrated before for this machine, model and job shape; "
            "delete it to measure again, or pass --profile)")
        return path
    command = calibrate_command(model, job, n_ranks, path)
    from ..models.cache import ensure_writable_cache

    ensure_writable_cache()
    path.parent.mkdir(parents=True, exist_ok=True)
    say(f"pipeinfer: {why}: no profile of these ranks yet; calibrating them quickly (`pipeinfer {_shown(command)}`, "
        f"about a minute on one machine, longer on slow hosts and where ranks are sent the model's layers), kept in "
        f"{path} for the next job of this shape")
    rc = run_calibration(command)
    if rc != 0 or not path.is_file():
        raise PipeinferError(f"{why}: the quick calibration failed (exit status {rc}); run `pipeinfer "
                             f"{_shown(command)}` to see why, or pass --profile FILE")
    return path


def _in_this_job(cfg: JobConfig, model: str, job, n_ranks: int, why: str, say) -> Path | None:
    """ensure_profile on every rank of a running job (the module doc)."""
    from ..transport.start_waits import start_timeout_s
    from ..transport.startup import job_startup
    from .calibrate_run import calibrate_in_job

    startup = job_startup()
    head = startup.link.rank == 0
    path = None
    if head:
        path = profile_path(cfg, job_key(cfg, n_ranks, job.threads, job.n_draft))
    # Every rank checks in (the head with whether it has the profile): the first start-up exchange.
    have = startup.check_in("profile", path.is_file() if head else None, deadline_s=start_timeout_s())[0]
    if have:
        say(f"pipeinfer: {why}: reusing profile {path} (calibrated before for this machine, model and job shape; "
            "delete it to measure again, or pass --profile)")
        return path
    command = "pipeinfer " + _shown(calibrate_command(model, job, n_ranks, path or Path("profile.json")))
    if head:
        from ..models.cache import ensure_writable_cache

        ensure_writable_cache()
        path.parent.mkdir(parents=True, exist_ok=True)
        say(f"pipeinfer: {why}: no profile of these {n_ranks} ranks yet; calibrating them quickly inside this job "
            f"(what `{command.replace(str(path), 'FILE')}` measures, about a minute), kept in {path} for the next job "
            "of this shape")
    calibrate_in_job(cfg, n_ranks, path, command)
    return path


def measured_profiles(cfg: JobConfig, job, n_ranks: int) -> dict[int, Profile]:
    """{threads: Profile} of this job calibrated at other thread counts (`--threads T`, cached by
    ensure_profile), for -M auto's search; empty where there are none."""
    from ..planner.profile import Profile, ProfileError
    from ..runtime.host_facts import host_facts

    out = {}
    if cfg.model_path is None:
        return out
    for t in range(1, int(host_facts().cores) + 1):
        path = profile_path(cfg, job_key(cfg, n_ranks, str(t), job.n_draft))
        if path.is_file():
            try:
                out[t] = Profile.load(path)
            except ProfileError:
                continue
    return out


def run_calibration(command: list[str]) -> int:
    """Run `pipeinfer calibrate …` (command: its argv after `pipeinfer`) and return its exit status.
    A stop signal (Ctrl-C, SIGTERM, SIGHUP) is passed on to it, and once it has stopped its job (every
    process, on every host, and their shared memory) this command ends with the same status: the
    calibration said `Error: interrupted` (or `Error: stopped by SIGTERM`) already, or this says it
    when it was stopped before it could."""
    import signal

    import typer

    from ..errors import error_line
    from ..transport.launch import pipeinfer_command, run_stoppable

    rc, stopped = run_stoppable(pipeinfer_command(command), stdout=subprocess.DEVNULL)
    if stopped is None:
        return rc
    if rc != 128 + stopped:  # it did not end as relaunch() ends after its one line (killed before it could)
        name = "interrupted" if stopped == signal.SIGINT else f"stopped by {signal.Signals(stopped).name}"
        print(error_line(name), file=sys.stderr, flush=True)
    raise typer.Exit(128 + stopped)


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
