"""Which job a profile (or a trace) describes, and whether it is the job being planned.

A profile holds what one model cost on one shape of job: its file (sha256), and per rank the
machine (CPU model, logical CPUs, the CPU the process may use), the threads it computed with and
how many ranks shared its host. A prediction from it is a prediction of that job only: another
model file, another thread count or ranks crowding a host differently cost something else. So the
planner compares the job it plans with the profile's and refuses any difference, naming each one
and the calibration that would measure it; --force plans anyway, with a warning.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..wording import plural


@dataclass(frozen=True)
class RankShape:
    """One rank of the job being planned: where it runs and how many threads it computes with.
    A fact the planner cannot know (a host that is not this one) is None and not compared."""

    rank: int
    threads: int
    ranks_per_host: int
    cpu: str | None = None
    cores: int | None = None
    usable_cpus: float | None = None
    omp_wait: str | None = None  # how its threads wait between graphs (job_wait); None: not compared


def model_sha256(path: Path, registry_sha256: str | None = None, registry_size: int | None = None) -> str:
    """A model file's identity, as weight streaming computes it (remembered per path, size and mtime)."""
    from ..models.model_identity import file_sha256, identify

    ident = identify(path, registry_sha256, registry_size)
    if ident is None:
        raise UsageError(f"no model file at {path}")
    return file_sha256(ident)


def default_threads(iterative: bool, n_ranks: int, ranks_per_host: int, cores: int, affinity_cpus: int,
                    quota_cpus: float | None, one_host: bool) -> int:
    """The threads per rank `generate` starts a job with when --threads is not given (the job
    `plan` predicts), from the rank's CPU share as calibrate recorded it (runtime/cpu_share.py):
    a job that `--ranks N` starts on one machine in iterative mode gives every rank all the CPUs
    its host grants it (cli/generate_cmd.whole_host_threads), unless OMP_WAIT_POLICY is set; else
    runtime/topology.default_threads: a rank bound to fewer CPUs than its host uses those, a cgroup
    quota is shared by the ranks on the host, otherwise the host's CPUs are."""
    cpus = min(float(affinity_cpus), quota_cpus) if quota_cpus else float(affinity_cpus)
    granted = max(1, min(affinity_cpus, math.ceil(cpus - 1e-9)))
    if iterative and one_host and n_ranks > 1 and "OMP_WAIT_POLICY" not in os.environ:
        return granted
    if affinity_cpus < cores:
        return granted
    if quota_cpus is not None:
        return max(1, math.ceil(cpus / max(1, ranks_per_host) - 1e-9))
    return max(1, cores // max(1, ranks_per_host))


def job_wait(iterative_whole_host: bool, ranks_per_host: int, affinity_cpus: int, quota_cpus: float | None,
             environ=os.environ) -> str:
    """How a rank of the planned job waits between graphs, as cli/app.omp_wait_policy decides it
    for the job's ranks: the user's OMP_WAIT_POLICY; passive under a CPU quota below its CPUs; active
    (briefly: GOMP_SPINCOUNT) for a rank of an iterative job that takes its host's CPUs
    (default_threads); passive where ranks share a host; else libgomp's default."""
    if "OMP_WAIT_POLICY" in environ:
        return environ["OMP_WAIT_POLICY"]
    if quota_cpus is not None and quota_cpus < affinity_cpus:
        return "passive"
    if iterative_whole_host:
        return "active"
    return "passive" if ranks_per_host > 1 else "default"


def differences(profile, shapes: list[RankShape], sha256: str | None, draft_sha256: str | None,
                calibrate: str) -> list[str]:
    """What differs between the job (`shapes`, the target's sha256, a draft model's sha256) and the
    job the profile measured, each difference with the calibration that measures the job. Empty: the
    same job. calibrate: the calibrate command line that would measure this job."""
    out = []
    if profile.model.sha256 is None or any(profile.ranks[s.rank].usable_cpus is None for s in shapes):
        return [f"the profile was made by an older pipeinfer, without the model's and the machine's identity: "
                f"run {calibrate} again"]
    if profile.model.sha256 != sha256:
        out.append(f"the profile was made for another file of the model ({profile.model.name}, sha256 "
                   f"{profile.model.sha256[:12]}, this one is {(sha256 or '?')[:12]}): run {calibrate}")
    d = profile.draft
    if draft_sha256 is not None and d is not None and d.is_model and d.sha256 not in (None, draft_sha256):
        out.append(f"the profile's draft {d.name} is another file (sha256 {d.sha256[:12]}, this one is "
                   f"{draft_sha256[:12]}): run {calibrate}")
    out += _rank_differences(profile, shapes, calibrate)
    return out


def _rank_differences(profile, shapes: list[RankShape], calibrate: str) -> list[str]:
    out = []
    threads = [(s, profile.ranks[s.rank]) for s in shapes if s.threads != profile.ranks[s.rank].threads]
    if threads:
        s, rc = threads[0]
        which = "" if len(threads) == len(shapes) else f" on rank {s.rank}"
        out.append(f"the profile was made for {plural(rc.threads, 'thread')} per rank{which}, this job uses "
                   f"{s.threads}: run {_with_threads(calibrate, s.threads)}")
    for s in shapes:
        rc = profile.ranks[s.rank]
        if rc.ranks_per_host is not None and rc.ranks_per_host != s.ranks_per_host:
            out.append(f"the profile's rank {s.rank} shared its host with {plural(rc.ranks_per_host - 1, 'other rank')}, "
                       f"in this job it shares it with {s.ranks_per_host - 1}: calibrate with the job's ranks on "
                       f"the same hosts")
            break
    waits = [(s, profile.ranks[s.rank]) for s in shapes
             if s.omp_wait is not None and profile.ranks[s.rank].omp_wait not in (None, s.omp_wait)]
    if waits:
        s, rc = waits[0]
        fix = (f"run {calibrate} without OMP_WAIT_POLICY in the environment (with as many threads per rank as the "
               f"host's CPUs its ranks then wait as this job's do)" if s.omp_wait == "active" else
               f"run {calibrate} with OMP_WAIT_POLICY={s.omp_wait} set")
        out.append(f"the profile's rank {s.rank} waited between graphs with OMP_WAIT_POLICY={rc.omp_wait}, this "
                   f"job's ranks wait with {s.omp_wait} (a rank of several threads computes at another speed): {fix}")
    for s in shapes:
        rc = profile.ranks[s.rank]
        mine = [(what, a, b) for what, a, b in (("CPU", rc.cpu, s.cpu), ("logical CPUs", rc.cores, s.cores),
                                                 ("usable CPUs", rc.usable_cpus, s.usable_cpus))
                if b is not None and a != b]
        if mine:
            diff = ", ".join(f"{what} {_fmt(a)} (now {_fmt(b)})" for what, a, b in mine)
            out.append(f"the profile measured rank {s.rank} on {rc.host} with {diff}: run {calibrate} on this machine")
    return out


def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _with_threads(calibrate: str, threads: int) -> str:
    parts = calibrate.split(" --threads ")
    if len(parts) == 2:
        rest = parts[1].split(" ", 1)
        return f"{parts[0]} --threads {threads}" + (f" {rest[1]}" if len(rest) > 1 else "")
    return f"{calibrate} --threads {threads}"


def check(diffs: list[str], force: bool, warn: Callable[[str], None]) -> None:
    """Refuse a job the profile did not measure (one line, every difference), or with --force warn once."""
    if not diffs:
        return
    text = "; ".join(diffs)
    if not force:
        raise UsageError(f"{text}; or pass --force to plan anyway")
    warn(f"warning: {text} (--force: planning anyway, the prediction is for the job the profile measured)")
