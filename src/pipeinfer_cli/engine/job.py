"""A generation job on every rank: plan, load once, run each request on the head, serve elsewhere.

A job runs one or more requests (prompt + mode) on models loaded once, so `bench` can interleave
modes on the same ranks. Between requests the head clears the KV caches (a stream operation) and
collects every rank's counters and trace events.

Fault handling: any rank that fails tells the head (ERROR); the head reports the error once and
tells every rank to stop (ABORT); every process then exits with status 1 within seconds, so an
`mpiexec` never hangs on a dead job.

Order matters: MPI launchers (Hydra, Open MPI) kill the whole job as soon as one process exits
without MPI_Finalize. So the other ranks wait for the head to leave first (at most ABORT_GRACE_S),
and the head leaves without finalizing only after the error has been printed: the message cannot be
lost, and the launcher tears the job down at once.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from mpi4py import MPI

from ..errors import PipeinferError, UsageError
from ..transport.messages import Tag
from ..transport.mpi_link import Backoff, Link
from .decode_sync import decode_iterative, decode_speculative, prefill
from .metrics import now, peak_rss_mib
from .sampling import SamplingParams
from .session import MODES, DecodeOptions, Session  # noqa: F401 - MODES is part of this module's API
from .text_stream import TextStream
from .topology import Topology, plan_job
from .trace import TraceRecorder



@dataclass
class Request:
    """One generation: a raw prompt or chat messages, and the decoding mode."""

    mode: str
    prompt: str | None = None  # raw text
    chat: list[dict] | None = None  # messages, formatted with the model's chat template
    label: str = ""  # prompt id, for reports
    stop: list[str] = field(default_factory=list)  # stop strings: generation ends where one appears


@dataclass
class JobConfig:
    model_path: Path
    model_label: str
    draft_path: Path | None  # GGUF draft model, or None
    draft_label: str | None  # registry name / path / "lookup"
    sampling: SamplingParams = field(default_factory=SamplingParams)
    decode: DecodeOptions = field(default_factory=DecodeOptions)
    n_ctx: int = 4096
    layer_split: str | None = None
    threads: str | None = None
    debug: bool = False


class JobFailed(PipeinferError):
    pass


def _error_text(exc: BaseException, debug: bool) -> str:
    msg = str(exc) if isinstance(exc, PipeinferError) else f"{type(exc).__name__}: {exc}"
    if debug:
        msg += "\n" + "".join(traceback.format_exception(exc))
    return msg


def hard_exit(code: int) -> None:
    """Leave without MPI_Finalize, which could wait forever on a dead peer."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


ERROR_WAIT_S = 5.0  # a failed rank waits this long for the head's ABORT before leaving anyway
ABORT_GRACE_S = 3.0  # a rank told to abort waits this long for the head to print the error and leave


def leave_after_head(code: int = 1) -> None:
    """A non-head rank of a failed job: let the head leave first, then exit without MPI_Finalize.

    The head prints the error and exits; the launcher then kills this process. If the head cannot
    (it is stuck or dead), leave after ABORT_GRACE_S: the launcher then ends the job."""
    time.sleep(ABORT_GRACE_S)
    hard_exit(code)


def head_failed() -> None:
    """The head of a failed multi-rank job: once the error is reported (at interpreter exit), leave
    without MPI_Finalize, so that the launcher stops the ranks waiting in leave_after_head at once."""
    atexit.register(hard_exit, 1)


def plan(cfg: JobConfig, world_size: int, ranks_per_host: int, needs_draft: bool = False) -> Topology:
    return plan_job(cfg.model_path, cfg.model_label, world_size, ranks_per_host, cfg.layer_split, cfg.threads,
                    cfg.draft_path, needs_draft)


def _spec_margin(cfg: JobConfig, req: Request) -> int:
    """KV cells beyond prompt + -n that a mode may fill: speculative runs in flight write past
    the last committed token (rejected cells are removed again)."""
    if req.mode == "iterative":
        return 1
    return cfg.decode.n_draft * (cfg.decode.max_inflight if req.mode == "pipeinfer" else 1) + 2


def n_predict_for(cfg: JobConfig, req: Request, n_prompt: int) -> int:
    """Tokens to generate: -n, or with -n -1 as many as the context holds (until end of text)."""
    if cfg.decode.n_predict > 0:
        return cfg.decode.n_predict
    return cfg.n_ctx - n_prompt - _spec_margin(cfg, req)


def make_drafter(cfg: JobConfig, threads: int):
    from .drafters import LlamaDrafter, LookupDrafter

    if cfg.draft_label == "lookup":
        return LookupDrafter()
    return LlamaDrafter(cfg.draft_path, n_ctx=cfg.n_ctx, n_threads=threads)


def run_job(cfg: JobConfig, requests: list[Request], on_start: Callable[[object], None] | None = None,
            on_token: Callable[[int], None] | None = None,
            on_result: Callable[[dict], None] | None = None,
            on_text: Callable[[str], None] | None = None) -> list[dict] | None:
    """Run on every rank of COMM_WORLD. Returns one result dict per request on the head, None elsewhere.

    on_start(tokenizer) is called on the head once the models are loaded; on_token(token) as each
    token is committed; on_text(text) with the text to show as tokens are committed (UTF-8
    completed, stop strings held back and cut); on_result(result) after each request.
    """
    comm = MPI.COMM_WORLD
    link = Link(comm)
    rank, size = link.rank, link.size
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    trace = TraceRecorder(rank)
    needs_draft = any(r.mode != "iterative" for r in requests)

    # Plan and load everywhere; a failure on any rank is reported once, by the head.
    state: dict = {}
    err = None
    try:
        topo = plan(cfg, size, local, needs_draft)
        state["topo"] = topo
        state.update(_load(cfg, topo, topo.ranks[rank], requests, needs_draft))
    except Exception as exc:  # noqa: BLE001 - forwarded to the head and reported there
        err = _error_text(exc, cfg.debug)
    errors = comm.allgather(err)
    if any(errors):
        if rank == 0:
            bad = next(r for r, e in enumerate(errors) if e)
            if size > 1:
                head_failed()
            raise JobFailed(errors[bad] if bad == 0 else f"rank {bad}: {errors[bad]}")
        leave_after_head(1)
    offsets = _clock_offsets(link)

    topo = state["topo"]
    if rank != 0:
        _serve(link, cfg, state, topo.ranks[rank], trace)
        return None
    return _head(link, cfg, state, topo, trace, requests, offsets, on_start, on_token, on_result, on_text)


def _clock_offsets(link: Link) -> list[float]:
    """Offset of each rank's perf_counter from the head's (NTP-style, best of 5 round trips)."""
    if link.size == 1:
        return [0.0]
    comm = link.comm
    if link.rank != 0:
        for _ in range(5):
            comm.recv(source=0, tag=int(Tag.CLOCK))
            comm.send(now(), dest=0, tag=int(Tag.CLOCK))
        return []
    offsets = [0.0]
    for r in range(1, link.size):
        best = None
        for _ in range(5):
            t0 = now()
            comm.send(None, dest=r, tag=int(Tag.CLOCK))
            t_r = comm.recv(source=r, tag=int(Tag.CLOCK))
            t1 = now()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, t_r - (t0 + t1) / 2)
        offsets.append(best[1])
    return offsets


def _load(cfg: JobConfig, topo: Topology, me, requests: list[Request], needs_draft: bool) -> dict:
    from ..native import LayerEngine

    out: dict = {}
    if me.role == "draft":
        if needs_draft:
            out["drafter"] = make_drafter(cfg, me.threads)
        return out
    # Sequences: the canonical one, plus one per in-flight run and tree branch (pipeinfer).
    n_seq = min(64, 2 + cfg.decode.max_inflight * max(1, cfg.decode.max_branches))
    out["engine"] = LayerEngine(str(cfg.model_path), me.layers[0], me.layers[1], n_ctx=cfg.n_ctx,
                                n_threads=me.threads, n_seq_max=n_seq)
    if me.role != "head":
        return out
    from .tokenizer import Tokenizer

    tok = Tokenizer(cfg.model_path)
    out["tokenizer"] = tok
    prompts = []
    for req in requests:
        ids = tok.chat_messages(req.chat) if req.chat is not None else tok.encode(req.prompt or "")
        if not ids:
            raise UsageError(f"prompt {req.label or ''} is empty; pass text with -p, -f or --chat".replace("  ", " "))
        n_predict = n_predict_for(cfg, req, len(ids))
        need = len(ids) + n_predict + _spec_margin(cfg, req)
        if n_predict < 1 or need > cfg.n_ctx:
            what = (f"with -n {cfg.decode.n_predict}" if cfg.decode.n_predict > 0 else "with -n -1")
            spec = " and the cells of speculative runs in flight" if _spec_margin(cfg, req) > 1 else ""
            raise UsageError(
                f"prompt {req.label + ' ' if req.label else ''}has {len(ids)} tokens; {what}{spec} it needs "
                f"{max(need, len(ids) + 1 + _spec_margin(cfg, req))} KV cells, more than --ctx {cfg.n_ctx}; "
                "raise --ctx or shorten the prompt"
            )
        prompts.append(ids)
    out["prompts"] = prompts
    if needs_draft and topo.draft_rank is None:
        if cfg.draft_label is None:
            raise UsageError("speculative and pipeinfer modes need a draft: pass --draft MODEL, --draft lookup, or a pair name")
        drafter = make_drafter(cfg, me.threads)
        if cfg.draft_label != "lookup":
            from .drafters import check_vocab_compatible

            check_vocab_compatible(tok, drafter, cfg.model_label, cfg.draft_label)
        out["drafter"] = drafter
    elif needs_draft and cfg.draft_path is not None:
        # The draft model runs on its own rank: check its vocabulary here, from the file alone.
        import llama_cpp

        from .drafters import check_vocab_compatible

        draft_tok = Tokenizer(cfg.draft_path)
        vocab = SimpleNamespace(n_vocab=draft_tok.n_vocab, vocab=draft_tok.vocab, lib=llama_cpp)
        check_vocab_compatible(tok, vocab, cfg.model_label, cfg.draft_label)
    return out


def _serve(link: Link, cfg: JobConfig, state: dict, me, trace) -> None:
    from .remote_draft import serve_draft
    from .stage import JobAborted, serve_stage

    try:
        if me.role == "draft":
            serve_draft(link, state.get("drafter"), me.threads, trace)
        else:
            serve_stage(link, state["engine"], me.threads, trace)
        link.flush()
    except JobAborted:
        leave_after_head(1)
    except Exception as exc:  # noqa: BLE001
        link.send_object(_error_text(exc, cfg.debug), 0, Tag.ERROR)
        link.flush(timeout_s=2)
        # Wait for the head's ABORT (it prints the error), but never longer than a few seconds.
        deadline = time.monotonic() + ERROR_WAIT_S
        backoff = Backoff(hi=10e-3)
        while time.monotonic() < deadline and link.probe(0, Tag.ABORT) is None:
            backoff.idle()
        if link.probe(0, Tag.ABORT) is not None:
            leave_after_head(1)
        hard_exit(1)


def abort_all(link: Link) -> None:
    """Tell every other rank to exit now (the job failed)."""
    for r in range(1, link.size):
        link.send_array(np.zeros(1, np.int64), r, Tag.ABORT)
    link.flush(timeout_s=2)


def _head(link: Link, cfg: JobConfig, state: dict, topo: Topology, trace, requests: list[Request],
          offsets: list[float], on_start, on_token, on_result, on_text=None) -> list[dict]:
    from .pipeline import Pipeline
    from .remote_draft import RemoteDrafter
    from .stage import fault_injection

    if (fail_at := fault_injection(0)) is not None:
        on_token = _failing_on_token(fail_at, on_token)
    tok = state["tokenizer"]
    drafter = RemoteDrafter(link, topo.draft_rank) if topo.draft_rank is not None else state.get("drafter")
    pipe = Pipeline(link if topo.world_size > 1 else None, state["engine"], topo.n_stages, trace, topo.draft_rank)
    if on_start:
        on_start(tok)
    results = []
    cumulative: dict[int, dict] = {}  # per rank: counters at the previous report
    try:
        for req, prompt in zip(requests, state["prompts"]):
            engine_before = state["engine"].stats()
            cpu_before = time.process_time()
            s = Session(prompt, cfg.sampling, n_predict_for(cfg, req, len(prompt)), tok.is_eog, on_token,
                        text=TextStream(tok.piece, req.stop), on_text=on_text)
            draft_prefill = None
            if drafter is not None and req.mode != "iterative":
                def draft_prefill(prompt=prompt):
                    t_draft = now()
                    drafter.start(prompt)
                    if topo.draft_rank is None:  # a draft rank traces its own work
                        trace.slice("draft", t_draft, now(), n_tokens=len(prompt), prefill=True)
            prefill(pipe, s, draft_prefill, draft_in_thread=topo.draft_rank is None)
            if req.mode == "iterative":
                decode_iterative(pipe, s, cfg.decode)
            elif req.mode == "speculative":
                local = topo.draft_rank is None  # a draft rank traces its own work
                decode_speculative(pipe, s, cfg.decode, _TracedDrafter(drafter, trace) if local else drafter)
            else:
                from .decode_pipeinfer import decode_pipeinfer

                decode_pipeinfer(pipe, s, cfg.decode, drafter)
            t_end = now()
            s.finish_text()
            _trace_commits(trace, s.metrics.token_times)
            # Reports travel behind every run of this request, so they see its final KV occupancy;
            # the clear after them readies the caches for the next request.
            reports = pipe.report()
            kv_used_head = state["engine"].kv_used_cells()
            pipe.kv_clear()
            head = {"rank": 0, "role": "head", "layers": list(topo.ranks[0].layers), "threads": topo.ranks[0].threads,
                    "peak_rss_mib": round(peak_rss_mib(), 1), "busy_s": round(pipe.busy_s, 4),
                    "cpu_s": round(time.process_time() - cpu_before, 3),
                    "engine": _delta(state["engine"].stats(), engine_before),
                    "kv_used_cells": kv_used_head, "trace": list(trace.events)}
            trace.events.clear()
            pipe.busy_s = 0.0
            for r in reports:  # stages report totals since start; keep this request's share
                prev = cumulative.get(r["rank"], {})
                cumulative[r["rank"]] = {k: r.get(k) for k in ("engine", "busy_s", "cpu_s", "runs")}
                for k in ("busy_s", "cpu_s", "runs"):
                    r[k] = round(r[k] - (prev.get(k) or 0), 4)
                if r.get("engine"):
                    r["engine"] = _delta(r["engine"], prev.get("engine") or {})
            result = _result(cfg, req, topo, tok, s, [head] + reports, offsets, t_end)
            if os.environ.get(DEBUG_DIVERGE) == req.mode:
                _debug_diverge(result)
            results.append(result)
            if on_result:
                on_result(result)
        pipe.shutdown()
    except BaseException:
        if topo.world_size > 1:
            head_failed()
            abort_all(link)
        raise
    finally:
        if drafter is not None:
            drafter.close()
    return results


def _failing_on_token(fail_at: int, on_token):
    """PIPEINFER_DEBUG_FAIL=0:N: the head raises when it commits its N-th token (fault tests)."""
    n = 0

    def wrapped(token: int) -> None:
        nonlocal n
        if on_token:
            on_token(token)
        n += 1
        if n >= fail_at:
            raise RuntimeError(f"injected fault (PIPEINFER_DEBUG_FAIL) on the head at token {n}")

    return wrapped


class _TracedDrafter:
    """A head-local drafter whose propose() calls become 'draft' slices on the head's track."""

    def __init__(self, drafter, trace: TraceRecorder):
        self._drafter, self._trace = drafter, trace

    def propose(self, path: list[int], n_max: int, p_min: float):
        t0 = now()
        prop = self._drafter.propose(path, n_max, p_min)
        self._trace.slice("draft", t0, now(), n_tokens=len(prop.tokens))
        return prop

    def __getattr__(self, name: str):
        return getattr(self._drafter, name)


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


# PIPEINFER_DEBUG_DIVERGE=MODE changes the last generated token of every MODE result (the result
# only, after generation), so tests can check that `bench` reports modes that disagree.
DEBUG_DIVERGE = "PIPEINFER_DEBUG_DIVERGE"


def _debug_diverge(result: dict) -> None:
    if result["tokens"]:
        result["tokens"] = result["tokens"][:-1] + [result["tokens"][-1] ^ 1]
        result["debug_diverged"] = True


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def _result(cfg: JobConfig, req: Request, topo: Topology, tok, s: Session, ranks: list[dict],
            offsets: list[float], t_end: float) -> dict:
    m = s.metrics.to_dict()
    for r in ranks:
        r["clock_offset_s"] = offsets[r["rank"]] if r["rank"] < len(offsets) else 0.0
        engine = r.get("engine") or {}
        m["runs"]["cancelled_mid_compute"] += engine.get("cancelled_mid_compute", 0)
        m["runs"]["layer_evals_skipped"] += engine.get("layer_evals_skipped", 0)
    return {
        "prompt_id": req.label, "mode": req.mode, "model": cfg.model_label, "draft": cfg.draft_label,
        "layer_split": topo.describe(), "n_ctx": cfg.n_ctx,
        "text": s.text.text if s.text is not None else tok.llm.detokenize(s.generated).decode("utf-8", errors="replace"),
        "tokens": s.generated, "finish_reason": s.finish_reason, **m, "t_start": s.metrics.t_start, "t_end": t_end,
        "ranks": ranks,
    }
