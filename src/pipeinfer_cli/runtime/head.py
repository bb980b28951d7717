"""The head (rank 0): run each request through the pipeline in its mode, then assemble its result.

For one request (`Head.run`): keep the reusable prefix of the previous request's KV cells or clear
them (`prefix_cache.py`), prefill the rest and decode in the request's mode with the request
runner (`decode/request.py`: the draft's own prefill overlapping the stages; on one stage in
pipeinfer mode deferred until drafting shows it may pay, `draft_economy.py`), give a suffix
drafter's corpus the request's tokens (`decode/suffix_corpus.py`), collect every rank's report
(they travel behind the request's runs), and turn the session and reports into a
`GenerationResult` (its `to_json()` is `generate --json`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..transport.mpi_link import Link
from ..decode.draft_economy import DraftMemory
from .handoff import wire_summary
from .loading import Loaded, n_predict_for, tokenize_request
from ..decode.metrics import now
from ..decode.modes import needs_draft
from .pipeline import Pipeline
from ..decode.prefix_cache import PrefixCache
from ..decode.request import DraftSite, Streaming
from ..decode.request import run_request as decode_request
from ..decode.result import GenerationResult, RankReport
from ..decode.session import CANONICAL_SEQ, Session
from ..decode.text_stream import TextStream
from ..decode.trace import TraceRecorder
from .rank_report import RankReporter, fault_injection
from .worker import abort_job

if TYPE_CHECKING:
    from ..decode.drafters import Drafter, AsyncDrafter
    from ..planner.job_config import JobConfig
    from .job_config import Request

# PIPEINFER_DEBUG_DIVERGE=MODE changes the last generated token of every MODE result (the result
# only, after generation), so tests can check that `bench` reports modes that disagree.
DEBUG_DIVERGE = "PIPEINFER_DEBUG_DIVERGE"


@dataclass
class Callbacks:
    """What the caller sees as the job runs (all optional, called on the head only)."""

    on_start: Callable[[object], None] | None = None  # tokenizer, once the models are loaded
    on_token: Callable[[int], None] | None = None  # each committed token
    on_text: Callable[[str], None] | None = None  # text to show (UTF-8 completed, stop strings cut)
    on_result: Callable[[GenerationResult], None] | None = None  # each request's result


def serve_requests(link: Link | None, cfg: JobConfig, loaded: Loaded, trace: TraceRecorder, requests: Iterable,
                   offsets: list[float], cb: Callbacks) -> list[GenerationResult]:
    """Run every request on the head; stop the other ranks at the end, or abort them on failure.

    requests: (Request, prompt token ids) pairs; an iterator may block until the next one comes
    (a server's queue) and ends the job by stopping."""
    results = []
    with Head(link, cfg, loaded, trace, offsets, cb) as head:
        for req, prompt in requests:
            results.append(head.run(req, prompt))
    return results


class Head:
    """The head's side of a job, one request at a time, on models loaded once (rank 0).

    Use it as a context manager: on a normal exit the other ranks are shut down; on an exception
    they are aborted. With `cfg.reuse_prefix` the KV caches keep the previous request's committed
    tokens between requests and the next request reuses what it may of them (`prefix_cache.py`);
    otherwise they are cleared after every request.
    """

    def __init__(self, link: Link | None, cfg: JobConfig, loaded: Loaded, trace: TraceRecorder, offsets: list[float],
                 cb: Callbacks | None = None):
        from .draft_setup import head_drafter, suffix_corpus

        self.link, self.cfg, self.loaded, self.trace, self.offsets = link, cfg, loaded, trace, offsets
        topo = self.topo = loaded.topo
        self.tokenizer = loaded.tokenizer
        self.drafter = head_drafter(cfg, loaded, link)
        self.corpus = suffix_corpus(self.drafter)  # suffix drafting's memory of the job's requests
        self.pipe = Pipeline(link if topo.world_size > 1 else None, loaded.engine, topo.n_stages, trace, topo.draft_rank,
                             wait_policy=link.wait_policy if link is not None else None)
        me = topo.ranks[0]
        self.report = RankReporter(0, "head", list(me.layers), me.threads, trace, loaded.engine, link, loaded.weights)
        self.prefix = PrefixCache(ubatch=cfg.decode.ubatch)
        self.draft_used = False  # a request has run the draft (its cache may hold tokens)
        self.draft_memory = DraftMemory()  # whether drafting can pay on one stage, learned by earlier requests
        cb = cb or Callbacks()
        if (fail_at := fault_injection(link)) is not None:
            cb = Callbacks(cb.on_start, _failing_on_token(fail_at, cb.on_token), cb.on_text, cb.on_result)
        self.cb = cb
        if cb.on_start:
            cb.on_start(loaded.tokenizer)

    def __enter__(self) -> "Head":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.pipe.shutdown()
            elif self.topo.world_size > 1:
                abort_job(self.link)
        finally:
            if self.drafter is not None:
                self.drafter.close()

    def tokenize(self, req: Request) -> list[int]:
        """The request's prompt tokens; UsageError if it is empty or does not fit --ctx."""
        return tokenize_request(self.cfg, self.tokenizer, req)

    def run(self, req: Request, prompt: list[int], cb: Callbacks | None = None) -> GenerationResult:
        """One request: its result (with the prompt tokens it reused).

        cb: this request's callbacks (on_token, on_text, on_result), else the job's."""
        cb = cb or self.cb
        keep, common = self.prefix.plan(prompt) if self.cfg.reuse_prefix else (0, 0)
        self._trim(keep)
        s = run_request(self.pipe, self.cfg, self.loaded, req, prompt, self.drafter, cb, self.trace, reuse=keep,
                        memory=self.draft_memory)
        t_end = now()
        if self.corpus is not None:
            self.corpus.add(s.tokens)  # the request's prompt and committed tokens, for the next ones
        _trace_commits(self.trace, s.metrics.token_times)
        # Only the committed tokens stay (a speculative batch may have written past an end of text);
        # the reports travel behind this, so they see exactly the committed length.
        self.pipe.seq_rm(CANONICAL_SEQ, len(s.tokens) - 1, -1)
        reports = self.pipe.report()
        counters = self.pipe.take_counters()
        self.report.busy_s, self.report.kv_at_start = counters.busy_s, counters.kv_at_start
        self.report.runs = s.metrics.runs.launched
        ranks = [self.report.take(rows_requested=counters.rows_requested)] + reports
        if self.cfg.reuse_prefix:
            self.prefix.after_request(prompt, s.tokens, max(r.kv_min_resume or 0 for r in ranks))
        else:
            self.pipe.kv_clear()
        self.draft_used |= needs_draft(req.mode)
        result = assemble_result(self.cfg, req, self.topo, self.tokenizer, s, ranks, self.offsets, t_end)
        result.reused_tokens, result.common_prefix_tokens = keep, common
        result.draft_vocab = self.loaded.draft_vocab
        if req.trace_depth is not None:
            result.prompt_trace = self._prompt_trace(req, prompt, s)
        if os.environ.get(DEBUG_DIVERGE) == req.mode:
            _debug_diverge(result)
        if cb.on_result:
            cb.on_result(result)
        return result

    def _prompt_trace(self, req: Request, prompt: list[int], s: Session):
        """The request's trace (planner/record.py), after its result is complete: the draft's chains
        are asked of the job's own draft model (on the head or its draft rank) when it drafts in
        the target's tokens; prompt lookup and translated or hybrid drafts record tokens only."""
        from ..planner.record import request_trace

        chains = (req.trace_depth and self.drafter is not None and self.cfg.draft_path is not None
                  and self.loaded.draft_vocab == "direct" and not self.cfg.draft.is_hybrid)
        self.draft_used |= bool(chains)
        return request_trace(req.label or "p", prompt, s.generated, s.finish_reason,
                             self.drafter if chains else None, req.trace_depth or 0)

    def _trim(self, keep: int) -> None:
        """Keep the first `keep` cells of the canonical sequence on every stage (nothing else is in
        the caches between requests), or clear them."""
        if keep:
            self.pipe.seq_rm(CANONICAL_SEQ, keep, -1)
        elif self.prefix.tokens:
            self.pipe.kv_clear()
            self.prefix.clear()

    def reset(self) -> None:
        """Clear every KV cache, the draft's too, and forget the previous request's tokens."""
        self.pipe.kv_clear()
        self.prefix.clear()
        if self.draft_used and self.drafter is not None:
            self.drafter.start([], 0)  # an empty prompt: the draft model's cache ends up empty

    def kv_used_cells(self) -> dict[int, int]:
        """KV cells in use per rank, after every operation sent so far (see `Pipeline.kv_usage`)."""
        return self.pipe.kv_usage()


def run_request(pipe: Pipeline, cfg: JobConfig, loaded: Loaded, req: Request, prompt: list[int], drafter: Drafter | AsyncDrafter | None, cb: Callbacks,
                trace: TraceRecorder, reuse: int = 0, memory: DraftMemory | None = None,
                draft_reuse: int | None = None) -> Session:
    """Generate one request of the job in its mode (`decode/request.py`); returns the finished session.

    What the job adds: the request's options, limit and stop strings, its streaming callbacks, and
    where its draft computes (a request restricted to prompt lookup drafts on the head).
    reuse, draft_reuse, memory: as `decode.request.run_request` takes them."""
    tok = loaded.tokenizer
    if req.lookup_only and drafter is not None:
        from .draft_setup import lookup_drafter

        drafter = lookup_drafter()
    local_draft = loaded.topo.draft_rank is None or req.lookup_only  # a draft rank traces its own work
    streaming = Streaming(cb.on_token, TextStream(tok.piece, req.stop), cb.on_text, req.cancelled)
    return decode_request(pipe, req.mode, prompt, req.decode or cfg.decode, drafter,
                          sampling=req.sampling or cfg.sampling, n_predict=n_predict_for(cfg, req, len(prompt)),
                          is_eog=tok.is_eog, streaming=streaming,
                          site=DraftSite(on_head=local_draft, threaded=local_draft, trace=trace),
                          reuse=reuse, draft_reuse=draft_reuse, memory=memory, resume=req.resume)


def assemble_result(cfg: JobConfig, req: Request, topo, tok, s: Session, ranks: list[RankReport], offsets: list[float],
                    t_end: float) -> GenerationResult:
    """One request's result: text, tokens, metrics (docs/json-output.md) and every rank's report."""
    runs = replace(s.metrics.runs)  # the session's counters, plus what the stages' engines counted
    for r in ranks:
        r.clock_offset_s = offsets[r.rank] if r.rank < len(offsets) else 0.0
        engine = r.engine or {}
        runs.cancelled_mid_compute += engine.get("cancelled_mid_compute", 0)
        runs.layer_evals_skipped += engine.get("layer_evals_skipped", 0)
    return GenerationResult(
        prompt_id=req.label, mode=req.mode, model=cfg.model_label, draft=cfg.draft_label,
        layer_split=topo.describe(), n_ctx=cfg.n_ctx,
        text=s.text.text if s.text is not None else tok.llm.detokenize(s.generated).decode("utf-8", errors="replace"),
        tokens=s.generated, finish_reason=s.finish_reason,
        **vars(s.metrics.rates()), acceptance=replace(s.metrics.acceptance), runs=runs,
        wire=wire_summary(ranks, len(s.generated), topo.n_stages).as_dict(),
        t_start=s.metrics.t_start, t_end=t_end, ranks=ranks, drafting=replace(s.metrics.drafting),
    )


def _failing_on_token(fail_at: int, on_token):
    """PIPEINFER_DEBUG_FAULT=0:raise:N: the head raises when it commits its N-th token (fault tests)."""
    n = 0

    def wrapped(token: int) -> None:
        nonlocal n
        if on_token:
            on_token(token)
        n += 1
        if n >= fail_at:
            raise RuntimeError(f"injected fault (PIPEINFER_DEBUG_FAULT) on the head at token {n}")

    return wrapped


def _trace_commits(trace: TraceRecorder, token_times: list[float]) -> None:
    """One 'commit' instant per group of tokens committed together, unless the decoder recorded its own."""
    if any(e[0] == "i" and e[1] == "commit" for e in trace.events):
        return
    i = 0
    while i < len(token_times):
        j = i
        while j + 1 < len(token_times) and token_times[j + 1] == token_times[i]:
            j += 1
        trace.instant("commit", token_times[i], n=j - i + 1)
        i = j + 1


def _debug_diverge(result: GenerationResult) -> None:
    if result.tokens:
        result.tokens = result.tokens[:-1] + [result.tokens[-1] ^ 1]
        result.debug_diverged = True
