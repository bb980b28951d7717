"""`pipeinfer calibrate` on every rank of a job: each rank's timings in turn, then the links.

The head leads. It orders the ranks to measure (calibrate_probes.measure_rank) in rounds: ranks on
different hosts at the same time, as a job runs them, and ranks that share a host one after another,
while every rank not measuring sleeps in a coarse wait (a probe every 10 ms at most), so that they
do not disturb each other's timings (`measure_rounds`). Then, for every link
a job uses (each target stage to the next, the last stage back to the head, the head to and from a
draft rank), the two ranks exchange messages of 1 to 256 rows of hidden states through the job's
`Link`, with its real waits, and the sender fits latency and bandwidth. The head assembles the
`Profile` (planner/profile.py), with a warning for every rank whose figures stayed noisy and
for ranks of the same hardware whose figures disagree (calibrate_noise.py).

Only the head needs the model file: a rank without it is sent the probe's slices by the head, or
reuses what its node cache holds (calibrate_weights.py), as a job's ranks are sent their layers.

Orders and results travel pickled on Tag.CALIBRATE; the messages of the link probe are arrays on
Tag.PAYLOAD, like hidden states. A rank that fails reports to the head, which ends the job with
one error naming the rank (the fault protocol of runtime/worker.py); with a --rank-timeout, a rank
that stops answering is named after that long (each measuring rank says it is computing).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime

import numpy as np

from ..decode.sampling import SamplingParams
from ..errors import UsageError, describe
from ..planner.profile import DraftCosts, LinkCosts, ModelFacts, Profile, RankCosts
from ..transport.exits import leave_after_head
from ..transport.liveness import HeadUnresponsiveError, Liveness
from ..transport.messages import Tag
from ..transport.mpi_link import Link
from ..transport.start_waits import start_timeout_s
from ..transport.startup import job_startup
from .calibrate_noise import twin_disagreements, unreliable_line
from .calibrate_probes import LINK_ROWS, ProbeSpec, fit_link, measure_rank
from .calibrate_weights import share_probe_weights
from .job import rank_names
from ..planner.job_config import JobConfig
from .rank_report import JobAborted
from ..planner.layout import Topology, parse_layer_split
from .weight_stream import local_files
from .worker import abort_job, end_without_head, fail_after_error

TURN_WAIT_MAX_S = 10e-3  # the longest sleep between probes of a rank waiting for its turn
LINK_WARMUP = 3  # untimed round trips per message size


def run_calibration(cfg: JobConfig, spec: ProbeSpec, command: str, say: Callable[[int | None, str], None]) -> Profile | None:
    """Run on every rank of COMM_WORLD: the Profile on the head, None elsewhere.

    say(rank, line): progress, called on the rank that measures (rank None: the head, of the job
    as a whole, e.g. the weights it streams); command: the command line, kept in the profile."""
    startup = job_startup()
    link = startup.link
    if not startup.started:
        startup.check_in("start", local_files(cfg), deadline_s=start_timeout_s())
    topo, info, err, code = None, None, None, 1
    try:
        cfg = dataclasses.replace(cfg, layer_split=calibration_split(cfg.layer_split, link.size))
        topo, info, spec = share_probe_weights(link, startup, cfg, spec, times_draft, lambda line: say(None, line))
    except Exception as exc:  # noqa: BLE001 - forwarded to the head and reported there, once
        err, code = describe(exc, traceback_too=cfg.debug), getattr(exc, "exit_code", 1)
    startup.check_in("loaded", 0, err, code)
    link.name_ranks(rank_names(topo, startup.hosts))
    if cfg.rank_timeout_s > 0 and link.size > 1:
        Liveness(link, cfg.rank_timeout_s).start()
    job = _Job(link, topo, info, spec, cfg.sampling, say, startup.hosts)
    if link.rank != 0:
        _serve(job, cfg.debug)
        return None
    try:
        ranks, draft, links = job.lead()
    except BaseException:
        if link.size > 1:
            abort_job(link)
        raise
    facts = ModelFacts(cfg.model_label, info.file_size, info.arch, info.n_layer, info.n_embd, info.n_vocab,
                       list(info.layer_bytes), info.output_bytes, identities(cfg, draft), info.kv_bytes_per_cell)
    for rc in ranks:  # ranks sharing a host share its cores and memory: a job is measured as it runs
        rc.ranks_per_host = startup.hosts.count(startup.hosts[rc.rank])
    warnings = [line for rc in ranks if (line := unreliable_line(rc.rank, rc.spread, spec.spread_limit))]
    return Profile(facts, ranks, links, draft, created=datetime.now(UTC).isoformat(timespec="seconds"),
                   command=command, warnings=warnings + twin_disagreements(ranks))


def times_draft(spec: ProbeSpec, topo: Topology, rank: int) -> bool:
    """Whether a rank of this topology times a draft model (and so needs its file): the draft rank,
    else the head."""
    where = topo.draft_rank if topo.draft_rank is not None else 0
    return spec.draft.uses_model and rank == where


def identities(cfg: JobConfig, draft: DraftCosts | None) -> str:
    """The target's sha256 (and the draft model's, set on `draft`): what a profile is matched by."""
    from ..planner.identity import model_sha256

    if draft is not None and draft.is_model and cfg.draft_path is not None:
        draft.sha256 = model_sha256(cfg.draft_path, cfg.draft_sha256, cfg.draft_size)
    return model_sha256(cfg.model_path, cfg.model_sha256, cfg.model_size)


def calibration_split(layer_split: str | None, n_ranks: int) -> str | None:
    """The split to calibrate with. --layer-split auto (auto/1) asks for the split a profile gives,
    which is what calibrate writes: it measures the same ranks with equal shares (which layers a
    rank holds in the job does not change what it measures; a draft rank stays one)."""
    if not layer_split:
        return layer_split
    fractions, n_draft = parse_layer_split(layer_split)
    if fractions is not None:
        return layer_split
    if n_ranks - n_draft < 1:
        raise UsageError(f"--layer-split {layer_split!r} needs at least {n_draft + 1} ranks; pass --ranks")
    return ",".join(["1"] * (n_ranks - n_draft)) + ("/1" if n_draft else "")


def measure_rounds(hosts: list[str]) -> list[list[int]]:
    """The ranks that measure together, round by round: the k-th rank of every host in round k
    (hosts[r]: rank r's host). Ranks on one host never measure at the same time."""
    seen: dict[str, int] = {}
    rounds: list[list[int]] = []
    for rank, host in enumerate(hosts):
        k = seen.get(host, 0)
        seen[host] = k + 1
        if k == len(rounds):
            rounds.append([])
        rounds[k].append(rank)
    return rounds


def link_pairs(topo: Topology) -> list[tuple[int, int]]:
    """The (sender, receiver) pairs a job of this topology sends hidden states, results or drafts over."""
    n = topo.n_stages
    pairs = [(i, i + 1) for i in range(n - 1)] + ([(n - 1, 0)] if n > 1 else [])
    if topo.draft_rank is not None:
        pairs += [(0, topo.draft_rank), (topo.draft_rank, 0)]
    return pairs


class _Job:
    """One rank's side of the calibration (the module doc)."""

    def __init__(self, link: Link, topo: Topology, info, spec: ProbeSpec, sampling: SamplingParams,
                 say: Callable[[int, str], None], hosts: list[str]):
        self.link, self.topo, self.info, self.spec, self.sampling, self.say = link, topo, info, spec, sampling, say
        self.hosts = hosts

    def runs_draft(self, rank: int) -> bool:
        """Whether the draft is measured on this rank: where the job would run it."""
        where = self.topo.draft_rank if self.topo.draft_rank is not None else 0
        return not self.spec.draft.is_none and rank == where

    def measure(self) -> tuple[RankCosts, DraftCosts | None]:
        r = self.link.rank
        with self.link.computing(observable=False):  # heartbeats say busy: the head's wait is not a lost message
            return measure_rank(self.spec, self.info, r, self.topo.ranks[r].threads, self.runs_draft(r),
                                self.sampling, lambda line: self.say(r, line))

    # -- the head ------------------------------------------------------------------------------
    def lead(self) -> tuple[list[RankCosts], DraftCosts | None, list[LinkCosts]]:
        link = self.link
        got: dict[int, tuple[RankCosts, DraftCosts | None]] = {}
        for together in measure_rounds(self.hosts):
            for r in together:
                if r != 0:
                    link.send_pickled(("measure",), r, Tag.CALIBRATE)
            if 0 in together:
                got[0] = self.measure()
            for r in together:
                if r != 0:
                    got[r] = self.await_from(r)
        ranks = [got[r][0] for r in range(link.size)]
        draft = next((d for r in range(link.size) if (d := got[r][1]) is not None), None)
        links = []
        for a, b in link_pairs(self.topo):
            self.say(0, f"link {a} -> {b}: round trips of {'/'.join(map(str, LINK_ROWS))} rows")
            links.append(self.lead_link(a, b))
        for r in range(1, link.size):
            link.send_pickled(("done",), r, Tag.CALIBRATE)
        if link.liveness is not None:
            liveness = link.liveness
            liveness.stop()
            link.flush()
            liveness.await_farewells()
        link.flush()
        return ranks, draft, links

    def lead_link(self, a: int, b: int) -> LinkCosts:
        for r in {a, b} - {0}:
            self.link.send_pickled(("link", a, b), r, Tag.CALIBRATE)
        if a == 0:
            return self.ping(b)
        if b == 0:
            self.pong(a)
        return self.await_from(a)

    def await_from(self, source: int):
        """Wait coarsely for a rank's pickled answer; a failure any rank reports is raised."""
        return self.await_message(source, self.link.raise_reported_error)

    def await_message(self, source: int, check: Callable[[], None]):
        link = self.link
        backoff = link.backoff(hi=TURN_WAIT_MAX_S)
        while link.probe(source, Tag.CALIBRATE) is None:
            check()
            link.progress_sends()
            link.idle(backoff, awaiting=(source, Tag.CALIBRATE))
        return link.recv_pickled(source, Tag.CALIBRATE)

    # -- another rank --------------------------------------------------------------------------
    def serve(self) -> None:
        """Carry out the head's orders until it says done."""
        link = self.link

        def check_abort() -> None:
            if link.abort_requested():
                raise JobAborted()

        while True:
            order = self.await_message(0, check_abort)
            if order[0] == "done":
                break
            if order[0] == "measure":
                link.send_pickled(self.measure(), 0, Tag.CALIBRATE)
            elif order[0] == "link":
                _, a, b = order
                if link.rank == a:
                    link.send_pickled(self.ping(b), 0, Tag.CALIBRATE)
                else:
                    self.pong(a)
        if link.liveness is not None:
            link.liveness.stop(farewell=True)
        link.flush()

    # -- the link probe ------------------------------------------------------------------------
    def ping(self, peer: int) -> LinkCosts:
        """Send messages of each size to peer, which answers each with one row; fit the link."""
        link, n_embd = self.link, self.info.n_embd
        rtt = {}
        for rows in LINK_ROWS:
            msg = np.zeros((rows, n_embd), np.float32)
            times = []
            for i in range(LINK_WARMUP + self.spec.link_reps):
                t0 = time.perf_counter()
                link.send_array(msg, peer, Tag.PAYLOAD)
                link.recv_array(peer, Tag.PAYLOAD, np.float32)  # the real wait: its wake-up counts
                if i >= LINK_WARMUP:
                    times.append(time.perf_counter() - t0)
            rtt[rows] = statistics.median(times)
        link.flush()
        return fit_link(link.rank, peer, n_embd, rtt)

    def pong(self, peer: int) -> None:
        link = self.link
        reply = np.zeros((1, self.info.n_embd), np.float32)
        for _ in range(len(LINK_ROWS) * (LINK_WARMUP + self.spec.link_reps)):
            link.recv_array(peer, Tag.PAYLOAD, np.float32)
            link.send_array(reply, peer, Tag.PAYLOAD)
        link.flush()


def _serve(job: _Job, debug: bool) -> None:
    """A non-head rank: the head's orders inside the job's fault protocol (runtime/worker.py)."""
    try:
        job.serve()
        job.link.drop_unreceived()
    except JobAborted:
        leave_after_head(1)
    except HeadUnresponsiveError as exc:
        end_without_head(job.link, exc)
    except Exception as exc:  # noqa: BLE001 - reported to the head, which prints it once
        fail_after_error(job.link, exc, debug)
