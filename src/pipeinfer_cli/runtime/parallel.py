"""`serve --parallel N`: up to N requests generate at once on one pipeline.

The pipeline thread takes requests off the service's queue while a slot is free and gives each its
own thread, which runs the request exactly as `Head.run` does, but on its slot's `SlotPipeline`
(runtime/slot_pipeline.py): its own KV cells and sequences on every stage, its own remembered
prefix, its runs interleaved with the other slots' in the stages. Speculation beside other
requests follows the load policy (decode/parallel_policy.py).

The job has one draft model (on the head or on a draft rank) and it drafts for one request at a
time: the request that finds it free holds it until it ends. Another request that needs a draft
meanwhile drafts by the job's model-free drafter when its draft has one (`lookup`, `suffix`,
`lookup+MODEL`, `suffix+MODEL`), else not at all; its tokens are the same either way (verification
keeps exactly the target's tokens), only its speed differs. Every request's suffix drafter shares
the job's corpus of earlier requests, which each finished request joins.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, TypedDict

from ..decode.draft_spec import DraftSpec
from ..decode.drafters import AsyncDrafter
from ..decode.metrics import now
from ..decode.modes import needs_draft
from ..decode.parallel_policy import DraftLender, Slot, SlotTable
from ..decode.session import CANONICAL_SEQ
from .draft_setup import fallback_drafter, lookup_drafter, suffix_corpus, suffix_drafter
from .head import Head, _trace_commits, assemble_result, run_request
from .slot_pipeline import MuxFailed, PipelineMux

if TYPE_CHECKING:
    from ..decode.drafters import Drafter
    from ..transport.mpi_link import Link
    from ..planner.job_config import JobConfig
    from .job_config import Request
    from .loaded import Loaded

JOIN_AFTER_FAILURE_S = 5.0  # how long the other slots' threads get to stop once one failed


class _Locked:
    """A draft rank's proxy whose calls hold the pipeline's lock: its messages share the link with
    the slots' runs."""

    def __init__(self, drafter: Drafter | AsyncDrafter | None, lock):
        self._drafter, self._lock = drafter, lock

    def __getattr__(self, name: str):
        attr = getattr(self._drafter, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            with self._lock:
                return attr(*args, **kwargs)

        return call


class DraftLease:
    """The job's draft model, lent to one request at a time (decode/parallel_policy.DraftLender
    decides who holds it; this builds each request's drafter and serialises the decisions)."""

    def __init__(self, drafter: Drafter | AsyncDrafter | None, draft: DraftSpec, lock):
        self.drafter, self.lock, self.spec = drafter, lock, draft
        self.free_only = draft.is_free  # lookup or suffix alone: every request has its own
        self.corpus = suffix_corpus(drafter)
        self.lender = DraftLender()
        self._mutex = threading.Lock()

    @property
    def holder(self) -> int | None:
        """The slot holding the draft model (None: nobody)."""
        return self.lender.holder

    def take(self, slot: int, reuse: int):
        """(drafter, draft_reuse, held) for a request in `slot` whose target keeps `reuse` tokens."""
        if self.drafter is None:
            return None, reuse, False
        if self.free_only:  # every request may have one (suffix drafters share the job's corpus)
            return (lookup_drafter() if self.spec.is_lookup else suffix_drafter(self.corpus)), reuse, False
        with self._mutex:
            held, draft_reuse = self.lender.take(slot, reuse)
        if not held:
            return fallback_drafter(self.spec, self.corpus), reuse, False
        drafter = _Locked(self.drafter, self.lock) if isinstance(self.drafter, AsyncDrafter) else self.drafter
        return drafter, draft_reuse, True

    @property
    def lent(self) -> bool:
        """Whether the job has a draft model that is lent to one request at a time (not lookup or
        suffix alone)."""
        return self.drafter is not None and not self.free_only

    def give_back(self, slot: int) -> None:
        with self._mutex:
            self.lender.give_back(slot)


class ParallelRunner:
    """The pipeline thread's loop over the service, and each slot's request."""

    def __init__(self, head: Head, service):
        cfg = head.cfg
        self.head, self.service, self.cfg = head, service, cfg
        self.mux = PipelineMux(head.pipe, cfg.parallel, cfg.load_policy)
        self.table = SlotTable(cfg.parallel, cfg.reuse_prefix, cfg.decode.ubatch)
        self.lease = DraftLease(head.drafter, cfg.draft, self.mux.lock)
        self.threads: dict[int, threading.Thread] = {}
        self.failure: BaseException | None = None
        self.freed = threading.Event()

    # -- the pipeline thread -------------------------------------------------------------------
    def serve(self) -> None:
        """Start requests while slots are free, until the service stops; raise a slot's failure."""
        service = self.service
        last_check = now()
        while True:
            if self.failure is not None:
                self._join(JOIN_AFTER_FAILURE_S)
                raise self.failure
            if service.status != "ok":
                self._join(None)
                if self.failure is not None:
                    raise self.failure
                return
            if not self.threads and now() - last_check > 0.5:
                self.mux.idle_check()  # an idle server notices a dead rank too
                last_check = now()
            if self.table.n_idle == 0:
                self.freed.wait(0.1)
                self.freed.clear()
                continue
            ticket = service.take_parallel(timeout=0.1)
            if ticket is not None:
                self._start(ticket)

    def _start(self, ticket) -> None:
        slot = self.table.pick(list(ticket.request.prompt))
        t = threading.Thread(target=self._work, args=(ticket, slot), name=f"slot-{slot.index}", daemon=True)
        self.threads[slot.index] = t
        t.start()

    def _join(self, timeout: float | None) -> None:
        for t in list(self.threads.values()):
            t.join(timeout)

    # -- a slot's thread ---------------------------------------------------------------------
    def _work(self, ticket, slot: Slot) -> None:
        service = self.service
        ended = False
        try:
            req = service.job_request(ticket)
            self.run(req, list(ticket.request.prompt), slot, service.ticket_callbacks(ticket), ticket)
            ended = True
        except MuxFailed:
            pass  # the slot that failed reports it
        except BaseException as exc:  # noqa: BLE001 - raised on the pipeline thread
            self.failure = self.failure or exc
            self.mux.fail(exc)
        finally:
            service.slot_info.pop(slot.index, None)
            self.table.release(slot)
            if ended:  # else the request stays among the running ones: service.fail() gives it its error
                service.release(ticket)
            self.threads.pop(slot.index, None)
            self.freed.set()

    def _holder_of_the_draft(self) -> dict[str, int | None] | None:
        """{"slot", "id_task"} of the request holding the job's draft model (None if it was just given back)."""
        holder = self.lease.holder
        info = self.service.slot_info.get(holder) if holder is not None else None
        ticket = (info or {}).get("ticket")
        return None if holder is None else {"slot": holder, "id_task": ticket.seq if ticket is not None else None}

    def run(self, req: Request, prompt: list[int], slot: Slot, cb, ticket=None):
        """One request in its slot: Head.run's steps on the slot's pipeline."""
        head, cfg, mux = self.head, self.cfg, self.mux
        view = mux.views[slot.index]
        keep, common = slot.prefix.plan(prompt) if cfg.reuse_prefix else (0, 0)
        if keep:
            view.seq_rm(CANONICAL_SEQ, keep, -1)
        elif slot.prefix.tokens:
            view.seq_rm(CANONICAL_SEQ)
            slot.prefix.clear()
        wants_draft = needs_draft(req.mode)
        drafter, draft_reuse, held = self.lease.take(slot.index, keep) if wants_draft else (None, keep, False)
        info = {"ticket": ticket, "mode": req.mode, "n_prompt_tokens": len(prompt), "reused_tokens": keep,
                "draft": drafter.name if wants_draft and drafter is not None else None}
        if wants_draft and self.lease.lent and not held:
            info["draft_model_held_by"] = self._holder_of_the_draft()
        self.service.slot_info[slot.index] = info
        with mux.lock:
            mux.active.add(slot.index)
        try:
            s = run_request(view, cfg, head.loaded, req, prompt, drafter, cb, head.trace, reuse=keep,
                            memory=head.draft_memory, draft_reuse=draft_reuse)
        finally:
            with mux.lock:
                mux.active.discard(slot.index)
            if held:
                self.lease.give_back(slot.index)
        t_end = now()
        if head.corpus is not None:
            head.corpus.add(s.tokens)  # it locks: other slots may be drafting from it
        _trace_commits(head.trace, s.metrics.token_times)
        view.seq_rm(CANONICAL_SEQ, len(s.tokens) - 1, -1)
        counters = view.take_counters()
        with mux.lock:
            reports = head.pipe.report()
            head.report.busy_s, head.report.kv_at_start = counters.busy_s, counters.kv_at_start
            head.report.runs = s.metrics.runs.launched
            ranks = [head.report.take(rows_requested=counters.rows_requested)] + reports
        if cfg.reuse_prefix:
            slot.prefix.after_request(prompt, s.tokens, max(r.kv_min_resume or 0 for r in ranks))
        else:
            view.seq_rm(CANONICAL_SEQ)
        result = assemble_result(cfg, req, head.topo, head.tokenizer, s, ranks, head.offsets, t_end)
        result.reused_tokens, result.common_prefix_tokens = keep, common
        result.draft_vocab = head.loaded.draft_vocab
        result.slot = slot.index
        if cb.on_result:
            cb.on_result(result)
        return result


class SlotRow(TypedDict, total=False):
    """One slot in GET /slots and /metrics (`slot_rows`): always id, n_ctx and is_processing."""

    id: int
    n_ctx: int | None
    is_processing: bool
    id_task: int
    n_decoded: int
    mode: str
    n_prompt_tokens: int
    reused_tokens: int
    draft: str | None
    draft_model_held_by: dict[str, int | None] | None


def slot_rows(service) -> list[SlotRow]:
    """What every slot of a service does (GET /slots, /metrics), in llama-server's manner: id,
    n_ctx, is_processing, and for a busy slot its request (id_task), mode, prompt tokens, tokens
    decoded so far, reused tokens and drafter; for a request that wanted the job's draft model
    while another request held it, draft_model_held_by (that request's slot and id_task)."""
    cfg = service.cfg
    out = []
    for i in range(cfg.parallel if cfg is not None else service.parallel):
        info = dict(service.slot_info.get(i) or {})
        ticket = info.pop("ticket", None)
        if ticket is None and cfg is not None and cfg.parallel == 1 and (ticket := service.current) is not None:
            info = {"mode": ticket.request.mode or service.default_mode(),
                    "n_prompt_tokens": len(ticket.request.prompt)}  # the FIFO server's one slot
        busy = ticket is not None and not ticket.finished
        row = {"id": i, "n_ctx": cfg.slot_ctx if cfg is not None else None, "is_processing": busy}
        if busy:
            row.update({"id_task": ticket.seq, "n_decoded": ticket.n_tokens, **info})
        out.append(row)
    return out


def serve_parallel(link: Link, cfg: JobConfig, loaded: Loaded, trace, service, offsets) -> None:
    """The head of a `serve --parallel N` job (N > 1): serve the service's requests until it stops."""
    callbacks = service.callbacks()
    with Head(link, cfg, loaded, trace, offsets, callbacks) as head:
        ParallelRunner(head, service).serve()
