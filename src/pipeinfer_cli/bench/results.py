"""From the head's records to everything a benchmark reports: checks, summary, header, files."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..wording import plural
from ..planner.layout import format_layer_ranges
from . import environment
from .runner import check_tokens
from .stats import summarize

if TYPE_CHECKING:
    from ..planner.job_config import JobConfig


@dataclass
class BenchResults:
    modes: list[str]
    records: list[dict]  # run order, warmups included, with per-rank trace events
    mismatches: list[dict]  # bench/runner.check_tokens
    summary: dict[str, dict]  # per mode, bench/stats.summarize
    header: dict  # versions, models, topology, host, config

    @property
    def mismatched_prompts(self) -> list[str]:
        return sorted({m["prompt_id"] for m in self.mismatches})

    def title(self) -> str:
        h = self.header
        draft = h["models"]["draft"]["name"] if h["models"].get("draft") else None
        topo = h["topology"]
        threads = ",".join(str(r["threads"]) for r in topo["ranks"])
        c = h["config"]
        return (f"{h['models']['target']['name']}" + (f" + draft {draft}" if draft else "")
                + f" · {plural(topo['world_size'], 'rank')}, layers {format_layer_ranges([r['layers'] for r in topo['ranks']])},"
                + f" threads {threads}"
                + f" · -n {c['n_predict']} · {plural(c['prompts']['count'], 'prompt')} × {plural(c['repeat'], 'repeat')}")


def describe_config(cfg: JobConfig, modes: list[str], prompts: list, prompts_file: Path | None, *, repeat: int, warmup: int,
                    ranks: int, layer_split: str | None, threads: str | None) -> dict:
    """What was asked for: modes, workload, sampling and decoding options, rank options."""
    from .prompts import default_prompts_path

    path = prompts_file or default_prompts_path()
    return {
        "modes": modes, "n_predict": cfg.decode.n_predict, "repeat": repeat, "warmup": warmup, "n_ctx": cfg.n_ctx,
        "prompts": {"path": str(path), "default": prompts_file is None, "count": len(prompts),
                    "ids": [p.id for p in prompts], "sha256": environment.file_sha256(path)},
        "sampling": vars(cfg.sampling), "decode": vars(cfg.decode),
        "ranks": ranks, "layer_split": layer_split, "threads": threads,
    }


def collect(records: list[dict], modes: list[str], models: dict, config: dict, command: str) -> BenchResults:
    """Check tokens, summarise, and build the reproducibility header (on the head, after the job)."""
    mismatches = check_tokens(records, modes)
    summary = summarize(records, modes, mismatches)
    header = {
        "created_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
        "versions": environment.versions(),
        "models": models,
        "topology": environment.topology(records[0]) if records else None,
        "host": environment.host_facts(),
        "config": config,
    }
    return BenchResults(modes, records, mismatches, summary, header)


def write_outputs(res: BenchResults, json_path: Path | None = None, csv_path: Path | None = None,
                  trace_path: Path | None = None, plot_path: Path | None = None) -> list[Path]:
    from .export import bench_document, write_csv, write_json

    written = []
    if json_path:
        write_json(json_path, bench_document(res.header, res.summary, res.mismatches, res.records))
        written.append(json_path)
    if csv_path:
        write_csv(csv_path, res.header, res.records)
        written.append(csv_path)
    if trace_path:
        from .chrome_trace import write_trace

        write_trace(trace_path, res.records, res.header)
        written.append(trace_path)
    if plot_path:
        from .plot import write_plot

        write_plot(plot_path, res.summary, res.records, res.modes, res.title())
        written.append(plot_path)
    return written
