"""A job's run saved as a trace (`generate --save-trace`, `bench --save-trace`) that `plan --trace`
replays: the requests' traces the head recorded (planner/record.request_trace) with the identities
`plan` checks a trace against, the model's and the draft's sha256 (as weight streaming computes
them), and where it ran: the head's machine, as `plan --record` writes it, and every rank's role,
threads and layers (for the record: greedy tokens depend on neither).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

from ..decode.result import GenerationResult
from ..errors import UsageError
from ..planner.identity import model_sha256
from ..planner.record import CHAIN_DEPTH
from ..planner.replay import Trace
from ..planner.job_config import JobConfig


def check_greedy(temperature: float, option: str = "--save-trace") -> None:
    """A trace replays greedy decoding: refuse to record one of a sampled run."""
    if temperature > 0:
        raise UsageError(f"{option} records greedy decoding (the draft's chains are its greedy tokens); run with "
                         f"--temp 0 (the default), not --temp {temperature:g}")


def job_trace(cfg: JobConfig, results: list[GenerationResult]) -> Trace:
    """The trace of the requests among `results` that recorded one (the first of each prompt id)."""
    prompts, seen = [], set()
    for r in results:
        pt = r.prompt_trace
        if pt is not None and pt.prompt_id not in seen:
            seen.add(pt.prompt_id)
            prompts.append(pt)
    depth = CHAIN_DEPTH if any(pt.chains for pt in prompts) else 0
    model = {"name": cfg.model_label, "file_bytes": Path(cfg.model_path).stat().st_size,
             "sha256": model_sha256(Path(cfg.model_path), cfg.model_sha256, cfg.model_size)}
    draft = None
    if cfg.draft:
        draft = {"name": cfg.draft_label, "kind": "lookup" if cfg.draft.is_free else "model",
                 "sha256": (model_sha256(Path(cfg.draft_path), cfg.draft_sha256, cfg.draft_size)
                            if cfg.draft_path is not None else None)}
    sampling = {"temp": cfg.sampling.temperature, "seed": cfg.sampling.seed}
    return Trace(model, draft, sampling, depth, prompts, _machine(results))


class TraceRank(TypedDict):
    rank: int
    role: str
    threads: int
    layers: list[int]


class TraceMachine(TypedDict):
    """Where a trace was recorded (its "machine"): this host as host_facts sees it, the head's
    threads, every rank's part and the layer split."""

    host: str
    cpu: str
    cores: int
    usable_cpus: float
    threads: int | None
    ranks: list[TraceRank]
    layer_split: str | None


def _machine(results: list[GenerationResult]) -> TraceMachine:
    from .host_facts import host_facts

    facts = host_facts()
    ranks = results[0].ranks if results else []
    head = next((r for r in ranks if r.rank == 0), None)
    return TraceMachine(host=facts.host, cpu=facts.cpu, cores=facts.cores, usable_cpus=facts.usable_cpus,
                        threads=None if head is None else head.threads,
                        ranks=[TraceRank(rank=r.rank, role=r.role, threads=r.threads, layers=r.layers) for r in ranks],
                        layer_split=results[0].layer_split if results else None)


def save_job_trace(path: Path, cfg: JobConfig, results: list[GenerationResult], say: Callable[[str], None]) -> Trace:
    """Write the trace atomically (whole or not at all) and say where, with what it holds."""
    trace = job_trace(cfg, results)
    trace.save(Path(path))
    chains = "with the draft's chains" if trace.depth else "tokens only (no draft model's chains)"
    if not trace.depth and cfg.draft_path is not None:
        chains = ("tokens only: a draft's chains are recorded for a draft model of the target's vocabulary alone; "
                  "plan this draft with --acceptance RATE")
    n_tok = sum(len(p.tokens) for p in trace.prompts)
    say(f"trace written to {path} ({len(trace.prompts)} prompt(s), {n_tok} tokens, {chains})")
    return trace
