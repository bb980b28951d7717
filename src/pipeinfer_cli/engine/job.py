"""One generation job on every rank: plan, load, run the mode on the head, serve on the others.

Fault handling: any rank that fails tells the head (ERROR); the head prints the error once and
tells every rank to stop (ABORT); every process then exits with status 1 within seconds, so an
`mpiexec` never hangs on a dead job.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ..errors import PipeinferError, UsageError
from ..gguf_info import read_model_info
from ..transport.messages import Tag
from ..transport.mpi_link import Backoff, Link
from .decode_sync import decode_iterative, decode_speculative, prefill
from .metrics import peak_rss_mib
from .sampling import SamplingParams
from .session import DecodeOptions, Session
from .topology import Topology, plan_topology
from .trace import TraceRecorder

MODES = ("iterative", "speculative", "pipeinfer")


@dataclass
class JobConfig:
    model_path: Path
    model_label: str
    draft_path: Path | None  # GGUF draft model, or None
    draft_label: str | None  # registry name / path / "lookup"
    mode: str
    prompt: str | None = None  # raw prompt text
    chat: list[dict] | None = None  # chat messages, formatted with the model's template
    sampling: SamplingParams = field(default_factory=SamplingParams)
    decode: DecodeOptions = field(default_factory=DecodeOptions)
    n_ctx: int = 4096
    layer_split: str | None = None
    threads: str | None = None
    debug: bool = False


class JobFailed(PipeinferError):
    pass


def _debug_detail(exc: BaseException, debug: bool) -> str:
    msg = str(exc) if isinstance(exc, PipeinferError) else f"{type(exc).__name__}: {exc}"
    if debug:
        msg += "\n" + "".join(traceback.format_exception(exc))
    return msg


def _hard_exit(code: int) -> None:
    """Leave without MPI_Finalize, which could wait on a dead peer."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def plan(cfg: JobConfig, world_size: int, ranks_per_host: int) -> Topology:
    info = read_model_info(cfg.model_path)
    if info.arch not in ("llama", "qwen2"):
        raise UsageError(f"{cfg.model_label}: architecture {info.arch!r} is not supported; supported: llama, qwen2")
    return plan_topology(world_size, cfg.layer_split, info.layer_bytes, info.output_bytes, cfg.threads, ranks_per_host)


def make_drafter(cfg: JobConfig, threads: int):
    from .drafters import LlamaDrafter, LookupDrafter

    if cfg.draft_label == "lookup":
        return LookupDrafter()
    return LlamaDrafter(cfg.draft_path, n_ctx=cfg.n_ctx, n_threads=threads)


def run_job(cfg: JobConfig, on_token: Callable[[int], None] | None = None,
            on_start: Callable[[object], None] | None = None) -> dict | None:
    """Run on every rank of COMM_WORLD. Returns the result dict on the head, None elsewhere.

    on_start(tokenizer) is called on the head once the models are loaded (to set up streaming).
    """
    comm = MPI.COMM_WORLD
    link = Link(comm)
    rank, size = link.rank, link.size
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    trace = TraceRecorder(rank)

    # Phase 1: plan and load everywhere; a failure on any rank is reported by the head.
    state: dict = {}
    err = None
    try:
        topo = plan(cfg, size, local)
        state["topo"] = topo
        me = topo.ranks[rank]
        state.update(_load(cfg, topo, me, rank))
    except Exception as exc:  # noqa: BLE001 - forwarded to the head and reported there
        err = _debug_detail(exc, cfg.debug)
    errors = comm.allgather(err)
    if any(errors):
        if rank == 0:
            first = next((r, e) for r, e in enumerate(errors) if e)
            raise JobFailed(first[1] if first[0] == 0 or size == 1 else f"rank {first[0]}: {first[1]}")
        _hard_exit(1)

    topo, me = state["topo"], state["topo"].ranks[rank]
    if rank != 0:
        _serve(link, cfg, state, me, trace)
        return None
    return _head(link, cfg, state, topo, trace, on_token, on_start)


def _load(cfg: JobConfig, topo: Topology, me, rank: int) -> dict:
    from ..native import LayerEngine

    out: dict = {}
    if me.role == "draft":
        out["drafter"] = make_drafter(cfg, me.threads)
        return out
    n_seq = max(2, cfg.decode.max_inflight * max(1, cfg.decode.max_branches) + 2)
    out["engine"] = LayerEngine(str(cfg.model_path), me.layers[0], me.layers[1], n_ctx=cfg.n_ctx,
                                n_threads=me.threads, n_seq_max=min(n_seq, 64))
    if rank == 0:
        from .tokenizer import Tokenizer

        tok = Tokenizer(cfg.model_path)
        out["tokenizer"] = tok
        if cfg.chat is not None:
            prompt = tok.chat_messages(cfg.chat)
        else:
            prompt = tok.encode(cfg.prompt or "")
        if not prompt:
            raise UsageError("the prompt is empty; pass text with -p, -f or --chat")
        if len(prompt) + cfg.decode.n_predict + cfg.decode.n_draft + 2 > cfg.n_ctx:
            raise UsageError(
                f"the prompt has {len(prompt)} tokens and -n asks for {cfg.decode.n_predict} more, which does not fit "
                f"--ctx {cfg.n_ctx}; raise --ctx or shorten the prompt"
            )
        out["prompt"] = prompt
        if cfg.mode != "iterative" and topo.draft_rank is None:
            if cfg.draft_label is None:
                raise UsageError(f"--mode {cfg.mode} needs a draft: pass --draft MODEL, --draft lookup, or a pair name")
            drafter = make_drafter(cfg, me.threads)
            if cfg.draft_label != "lookup":
                from .drafters import check_vocab_compatible

                check_vocab_compatible(tok, drafter, cfg.model_label, cfg.draft_label)
            out["drafter"] = drafter
    return out


def _serve(link: Link, cfg: JobConfig, state: dict, me, trace) -> None:
    from .remote_draft import serve_draft
    from .stage import JobAborted, serve_stage

    try:
        if me.role == "draft":
            stats = serve_draft(link, state["drafter"], me.threads, trace)
        else:
            stats = serve_stage(link, state["engine"], me.threads, trace)
        stats["trace"] = trace.events
        link.send_object(stats, 0, Tag.STATS)
        link.flush()
    except JobAborted:
        _hard_exit(1)
    except Exception as exc:  # noqa: BLE001
        link.send_object(_debug_detail(exc, cfg.debug), 0, Tag.ERROR)
        link.flush(timeout_s=2)
        # Wait for the head's ABORT (it prints the error), but never longer than a few seconds.
        deadline = time.monotonic() + 5
        backoff = Backoff()
        while time.monotonic() < deadline and link.probe(0, Tag.ABORT) is None:
            backoff.idle()
        _hard_exit(1)


def _abort_all(link: Link) -> None:
    for r in range(1, link.size):
        link.send_array(np.zeros(1, np.int64), r, Tag.ABORT)
    link.flush(timeout_s=2)


def _head(link: Link, cfg: JobConfig, state: dict, topo: Topology, trace, on_token, on_start) -> dict:
    from .pipeline import Pipeline
    from .remote_draft import RemoteDrafter

    tok = state["tokenizer"]
    drafter = state.get("drafter")
    if topo.draft_rank is not None:
        drafter = RemoteDrafter(link, topo.draft_rank)  # idles in iterative mode
    pipe = Pipeline(link if topo.world_size > 1 else None, state["engine"], topo.n_stages, trace, topo.draft_rank)
    if on_start:
        on_start(tok)
    s = Session(state["prompt"], cfg.sampling, cfg.decode.n_predict, tok.is_eog, on_token)
    try:
        prefill(pipe, s)
        if cfg.mode == "iterative":
            decode_iterative(pipe, s, cfg.decode)
        elif cfg.mode == "speculative":
            decode_speculative(pipe, s, cfg.decode, drafter)
        else:
            from .decode_pipeinfer import decode_pipeinfer

            decode_pipeinfer(pipe, s, cfg.decode, drafter)
        stage_stats = pipe.shutdown() if topo.world_size > 1 else []
    except BaseException:
        if topo.world_size > 1:
            _abort_all(link)
        raise
    head_stats = {"rank": 0, "role": "head", "layers": list(topo.ranks[0].layers), "threads": topo.ranks[0].threads,
                  "peak_rss_mib": round(peak_rss_mib(), 1), "busy_s": round(pipe.busy_s, 4),
                  "cpu_s": round(time.process_time(), 3), "engine": state["engine"].stats(),
                  "trace": trace.events}
    ranks = [head_stats] + stage_stats
    m = s.metrics.to_dict()
    engines = [r.get("engine") or {} for r in ranks]
    m["runs"]["cancelled_mid_compute"] = sum(e.get("cancelled_mid_compute", 0) for e in engines)
    m["runs"]["layer_evals_skipped"] = sum(e.get("layer_evals_skipped", 0) for e in engines)
    result = {
        "mode": cfg.mode, "model": cfg.model_label, "draft": cfg.draft_label,
        "layer_split": topo.describe(), "n_ctx": cfg.n_ctx,
        "text": tok.llm.detokenize(s.generated).decode("utf-8", errors="replace"),
        "tokens": s.generated, **m,
        "ranks": ranks,
    }
    if drafter is not None:
        drafter.close()
    return result
