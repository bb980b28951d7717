"""`plan --parallel N`: N requests at once, as `serve --parallel N` serves them, in virtual time.

N clients share the prompt set in order, each sending its next prompt when its previous one ends
(the closed loop of `bench --concurrency N`), all starting at once. The server's own scheduling
code runs them: `SlotTable` picks each request's slot, `may_speculate` (the load policy) decides
every speculative run, `DraftLender` lends the job's draft model to one request at a time
(decode/parallel_policy.py), and each request's mode runs unchanged on its slot of one simulated
pipeline (planner/sim_slots.py), whose stages take the runs of every request in launch order.

Modelled: the slots' sequences and cells (--ctx / N), runs of different requests interleaved in
the stages, the head's layers and drafting serial on the head's clock, speculation under load,
one draft model for the job (the others draft by lookup only with `--draft lookup`, else not at
all). Not modelled (see `plan --help`): HTTP, tokenizing and streaming; prefix reuse between
requests (every prompt is read whole); requests waiting for a slot (there are as many clients as
slots); the head's own Python time per request beside the others and its threads' wake-ups; ranks
sharing cores (as for one request).

The figures are those of `bench --concurrency N`: aggregate tok/s = generated tokens / time from
the first request's start to the last token, TTFT and ITL p50/p99 over every request (ITL over
every gap between token arrivals), and the same load with one client (`serve --parallel 1`'s one
request at a time) for the ratio.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from ..decode.draft_economy import DraftMemory
from ..decode.draft_spec import LOOKUP
from ..decode.drafters import Drafter, NoDraft
from ..decode.modes import needs_draft
from ..decode.parallel_policy import DraftLender, SlotTable
from ..decode.request import DraftSite
from ..decode.request import run_request as decode_request
from ..decode.sampling import SamplingParams
from ..decode.session import CANONICAL_SEQ, DecodeOptions, Session
from ..decode.slot_geometry import SlotGeometry
from .predict import Topology, build_pipeline, make_drafter
from .profile import Profile
from .replay import PromptTrace
from .sim_slots import SimSlot, SlotMux, TurnTaking


@dataclass
class LoadPrediction:
    """One mode's figures under a load of `parallel` requests at once (an entry of `plan --parallel
    N --json`'s "modes")."""

    mode: str
    parallel: int
    load_policy: str
    n_requests: int
    n_gen: int
    wall_s: float
    tok_per_s: float | None  # aggregate: every request's tokens over the wall time
    ttft_ms: dict[str, float | None]  # p50, p99 over the requests
    itl_ms: dict[str, float | None]  # p50, p99 over every gap between token arrivals
    utilisation: list[float]  # per stage: its share of the wall time computing
    settings: dict  # layer_split, draft
    requests: list[dict] = field(default_factory=list)  # per request: prompt_id, slot, start_s, ttft_s, end_s, n_gen
    one_at_a_time: dict | None = None  # the same prompts with one client: tok_per_s, ttft_ms, itl_ms
    vs_one_at_a_time: float | None = None  # aggregate tok/s against one client's

    def to_json(self) -> dict:
        return dict(vars(self))


@dataclass
class RequestRecord:
    """One request of the load, as the client saw it (virtual seconds from the load's start)."""

    prompt_id: str
    slot: int
    start_s: float  # sent: when its client's previous request ended (0 for the first)
    ttft_s: float | None  # from its sending: a request that found the head busy with another's waited
    end_s: float | None  # its last token
    n_gen: int
    itl_ms: list[float]  # the gaps between its token arrivals

    def to_json(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "itl_ms"}


def _pct(values: list[float]) -> dict[str, float | None]:
    """p50 and p99, linear between closest ranks (as bench --concurrency computes them)."""
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


class _Server:
    """The parallel server's part that the load meets: slots, the draft model's lease, the job's
    draft memory, and the clients' shared queue of prompts."""

    def __init__(self, profile: Profile, topo: Topology, mode: str, replay, opts: DecodeOptions, parallel: int,
                 load_policy: str, n_ctx: int):
        self.profile, self.topo, self.mode, self.replay, self.opts = profile, topo, mode, replay, opts
        geometry = SlotGeometry.for_job(n_ctx, parallel, opts.max_inflight, opts.max_branches,
                                        drafts=needs_draft(mode))
        self.sim = build_pipeline(profile, topo, replay.prompts[0], opts, geometry.n_ctx)
        self.turns = TurnTaking(self.sim)
        self.mux = SlotMux(self.sim, geometry, load_policy, self.turns)
        self.table = SlotTable(parallel, reuse_prefix=False)
        self.lender = DraftLender()
        self.memory = DraftMemory()
        self.queue: deque[PromptTrace] = deque(replay.prompts)
        self.records: list[RequestRecord] = []

    def client(self) -> None:
        """One client: the next prompt of the set as soon as its previous request ended."""
        sent = 0.0  # every client sends its first request at once
        while self.queue:
            pt = self.queue.popleft()
            slot = self.table.pick(list(pt.prompt))
            try:
                self.records.append(self.serve(self.mux.views[slot.index], pt, sent))
            finally:
                self.table.release(slot)
            sent = self.sim.t

    def serve(self, view: SimSlot, pt: PromptTrace, sent: float) -> RequestRecord:
        """One request in its slot, as runtime/parallel.ParallelRunner.run serves it."""
        view.token_of = pt.token_after
        drafter, held = self._drafter(view.index, pt)
        self.mux.active.add(view.index)
        try:
            s = run_slot_request(view, self.mode, pt, self.opts, drafter, self.topo.draft == "head", self.memory)
        finally:
            self.mux.active.discard(view.index)
            if held:
                self.lender.give_back(view.index)
        view.seq_rm(CANONICAL_SEQ)  # no prefix reuse: the slot's next request starts empty
        times = s.metrics.token_times
        return RequestRecord(pt.prompt_id, view.index, sent, times[0] - sent if times else None,
                             times[-1] if times else None, len(s.generated),
                             (np.diff(np.unique(np.asarray(times))) * 1e3).tolist())

    def _drafter(self, slot: int, pt: PromptTrace):
        """(drafter, held): lookup for every request; the draft model for the one holding it, no draft
        for the others (runtime/parallel.DraftLease)."""
        if not needs_draft(self.mode):
            return None, False
        if self.topo.draft == LOOKUP:
            return make_drafter(self.profile, self.topo, self.sim, self.replay.index(pt)), False
        held, _ = self.lender.take(slot, 0)
        if not held:
            return NoDraft(), False
        # A drafter per request (its chains are the request's); a draft rank's busy time is the
        # shared pipeline's, so it serves one request after the other.
        return make_drafter(self.profile, self.topo, self.sim, self.replay.index(pt)), True


def run_slot_request(view: SimSlot, mode: str, pt: PromptTrace, opts: DecodeOptions, drafter: Drafter | None,
                     draft_on_head: bool, memory: DraftMemory) -> Session:
    """A request of the trace in `mode` on its slot, through the request runner the head uses
    (decode/request.py), on the slot's virtual clock; its tokens must be the trace's."""
    s = decode_request(view, mode, list(pt.prompt), replace(opts, n_predict=len(pt.tokens)), drafter,
                       sampling=SamplingParams(), n_predict=len(pt.tokens), is_eog=pt.is_eog,
                       site=DraftSite(on_head=draft_on_head, threaded=False), memory=memory, clock=view.clock)
    if s.generated != pt.tokens[:len(s.generated)]:
        raise AssertionError(f"{mode} replayed tokens other than the trace's beside other requests: the simulation "
                             "lost a token")
    return s


def run_load(profile: Profile, topo: Topology, mode: str, replay, opts: DecodeOptions, parallel: int,
             load_policy: str = "yield", n_ctx: int = 4096) -> LoadPrediction:
    """The prompts of `replay` sent by `parallel` clients at once to a server of `parallel` slots."""
    server = _Server(profile, topo, mode, replay, opts, parallel, load_policy, n_ctx)
    for i in range(min(parallel, len(replay.prompts))):
        server.turns.spawn(f"client-{i}", server.client)
    server.turns.run()
    recs = sorted(server.records, key=lambda r: (r.start_s, r.slot))
    n_gen = sum(r.n_gen for r in recs)
    wall = max((r.end_s for r in recs if r.end_s is not None), default=0.0)
    ttft = [r.ttft_s * 1e3 for r in recs if r.ttft_s is not None]
    itl = [g for r in recs for g in r.itl_ms]
    return LoadPrediction(mode, parallel, load_policy, len(recs), n_gen, wall, n_gen / wall if wall > 0 else None,
                          _pct(ttft), _pct(itl), [b / wall if wall > 0 else 0.0 for b in server.sim.busy_s],
                          {"layer_split": topo.describe(), "draft": topo.draft}, [r.to_json() for r in recs])


def plan_load(profile: Profile, topo_of: Callable[[str], Topology], modes: list[str], replay, opts: DecodeOptions,
              n_ctx: int, parallel: int, load_policy: str = "yield") -> dict[str, LoadPrediction]:
    """{mode: its figures at `parallel` requests at once, beside one request at a time}."""
    out = {}
    for m in modes:
        topo = topo_of(m)
        p = run_load(profile, topo, m, replay, opts, parallel, load_policy, n_ctx)
        one = run_load(profile, topo, m, replay, opts, 1, load_policy, n_ctx) if parallel > 1 else p
        p.one_at_a_time = {"tok_per_s": one.tok_per_s, "ttft_ms": one.ttft_ms, "itl_ms": one.itl_ms,
                           "wall_s": one.wall_s}
        p.vs_one_at_a_time = p.tok_per_s / one.tok_per_s if p.tok_per_s and one.tok_per_s else None
        out[m] = p
    return out
