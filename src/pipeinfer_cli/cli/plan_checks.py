"""`pipeinfer plan`'s checks that the profile and the trace describe the job being planned
(planner/identity.py): the model's files, the threads each mode's job would use, the ranks per
host and, for the ranks that the profile measured on this host, this machine; and that ranks
which compute at once on one host are ones the planner can model (planner/shared_cores.py)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

from ..decode.modes import needs_draft
from ..planner.identity import RankShape, check, differences, job_wait
from ..planner.job_placement import job_threads
from ..planner.shared_cores import unmodelled, usable_cpus


def job_waits(prof, mode: str, threads: str | None, n_ranks: int) -> list[str]:
    """How each rank of that job waits between graphs (planner/identity.job_wait)."""
    hosts = [prof.ranks[r].host for r in range(n_ranks)]
    out = []
    for r in range(n_ranks):
        rc = prof.ranks[r]
        affinity = rc.affinity_cpus if rc.affinity_cpus is not None else rc.cores
        whole = not needs_draft(mode) and not threads and len(set(hosts)) == 1 and n_ranks > 1
        out.append(job_wait(whole, hosts.count(hosts[r]), affinity, rc.quota_cpus))
    return out


def job_shapes(prof, mode: str, threads: str | None, n_ranks: int) -> list[RankShape]:
    """The ranks of the planned job; this machine's facts for the ranks the profile measured here."""
    from ..runtime.host_facts import host_facts

    here = socket.gethostname()
    facts = host_facts() if any(prof.ranks[r].host == here for r in range(n_ranks)) else None
    hosts = [prof.ranks[r].host for r in range(n_ranks)]
    shapes = []
    waits = job_waits(prof, mode, threads, n_ranks)
    for r, t in enumerate(job_threads(prof, mode, threads, n_ranks)):
        mine = facts if hosts[r] == here else None
        shapes.append(RankShape(r, t, hosts.count(hosts[r]), mine and mine.cpu, mine and mine.cores,
                                mine and mine.usable_cpus, waits[r] if t > 1 else None))
    return shapes


def calibrate_command(prof, setup) -> str:
    """The calibrate command that measured the profile, else one that would measure this job."""
    if prof.command.startswith("pipeinfer calibrate "):
        return f"`{prof.command}`"
    return f"`pipeinfer calibrate {setup.label} --ranks {setup.n_ranks}`"


def check_job(setup, modes: list[str], threads: str | None, force: bool, warn: Callable[[str], None]) -> None:
    """Refuse (or with --force, warn about) a plan whose job the profile did not measure. A
    difference that holds for some of the modes only (their default threads) names them."""
    prof = setup.profile
    cmd = calibrate_command(prof, setup)
    seen: dict[str, list[str]] = {}
    sharing: set[str] = set()
    for m in modes:
        shapes = job_shapes(prof, m, threads, setup.n_ranks)
        for d in differences(prof, shapes, setup.sha256, setup.draft_sha256 if needs_draft(m) else None, cmd):
            seen.setdefault(d, []).append(m)
        if overlaps(m, setup.topology(m).draft):
            d = unmodelled([(s.rank, prof.ranks[s.rank].host, s.threads, usable_cpus(prof.ranks[s.rank]))
                            for s in shapes])
            if d is not None:
                seen.setdefault(d, []).append(m)
                sharing.add(d)
    lines = []
    for d, ms in seen.items():
        if "thread" in d.split(":")[0] and not threads and d not in sharing:
            d = f"{d}, or plan (and run) the job with --threads {prof.ranks[0].threads}"
        lines.append(d if len(ms) == len(modes) else f"{'/'.join(ms)}: {d}")
    fine = [m for m in modes if not any(m in ms for ms in seen.values())]
    if lines and fine:
        lines[-1] += f", or plan --modes {','.join(fine)} alone"
    check(lines, force, warn)
    for line in prof.warnings:  # what calibrate said about its figures (noise, twins that disagree)
        warn(f"warning: the profile's calibration said: {line}")


def overlaps(mode: str, draft) -> bool:
    """Whether ranks of the job compute at the same time: pipeinfer's runs in flight, and a draft
    rank reading the prompt while the head does (in any mode that drafts)."""
    return mode == "pipeinfer" or (needs_draft(mode) and isinstance(draft, int))


def check_trace(trace, path: Path, setup, force: bool, warn: Callable[[str], None]) -> None:
    """A trace holds the target's tokens and the draft's chains: refuse one of other files."""
    diffs = []
    sha = trace.model.get("sha256")
    if sha is None:
        diffs.append(f"the trace {path} was recorded by an older pipeinfer, without the model's identity: record it "
                     "again (--record)")
    elif sha != setup.sha256:
        diffs.append(f"the trace {path} was recorded with another file of {trace.model.get('name')} (sha256 "
                     f"{sha[:12]}, this one is {(setup.sha256 or '?')[:12]}): record one with this model (--record)")
    draft_sha = (trace.draft or {}).get("sha256")
    if trace.depth and setup.draft_sha256 is not None and draft_sha not in (None, setup.draft_sha256):
        diffs.append(f"the trace's draft chains were recorded with another draft ({trace.draft.get('name')}): record "
                     "them with this draft (--record)")
    check(diffs, force, warn)
