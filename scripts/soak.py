#!/usr/bin/env python3
"""Soak: one job serves many requests in a row, and nothing may leak or drift.

    .venv/bin/python scripts/soak.py --requests 1000 --json build/soak.json     # make soak
    .venv/bin/python scripts/soak.py --requests 100                             # the test's version

The job (SmolLM2 on 3 ranks, the draft model on the head; seeded sampling at a temperature, so
drafts are refused and runs cancelled; token trees on) runs the three modes, model and lookup drafts,
random prompts and random lengths (seeded). Every CONTROL_EVERY-th request is the same control
prompt, in turn in each mode and with each draft. After every request each rank reports (through
the job's own per-request reports) its KV cells in use, resident memory, open file descriptors and
threads. Checked:

- KV cells in use are 0 on every rank when each request starts (after the previous one's clear);
  the most cells beyond the request's tokens at its end, per mode, are reported;
- resident memory on every rank grows less than RSS_GROWTH_MAX after warm-up (the first
  WARMUP_FRACTION of the requests, which start with every mode and draft at the longest prompt
  and length: the KV cache's pages and the compute buffers are touched on first use);
- file descriptors and threads on every rank never exceed their count at the end of warm-up;
- the control prompt's tokens never change (same tokens in every mode, every time).

Exit status 1 if a check failed. The script starts the job itself, through pipeinfer's launcher.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

MODES = ("iterative", "speculative", "pipeinfer")
CONTROL = "List three prime numbers and explain why each one is prime."
CONTROL_EVERY = 10
CONTROL_N = 24
WARMUP_FRACTION = 0.1  # and at least the 6 warm-up requests (build_requests)
# ... and at least this many (half a short run): in an 80-request run, the last stage's memory was
# still growing 12 % after 8 requests (allocations for batch shapes met for the first time).
WARMUP_MIN = 30
N_MAX = 40  # random lengths are 1..N_MAX tokens
RSS_GROWTH_MAX = 0.05
PROMPTS = [
    ("chat", "Write a haiku about the sea."),
    ("chat", "What is the capital of Japan?"),
    ("chat", "Write a Python function that reverses a string."),
    ("chat", "Explain photosynthesis to a child."),
    ("chat", "Give me three tips for learning to cook."),
    ("chat", "Summarise the plot of Romeo and Juliet in two sentences."),
    ("raw", "The quick brown fox"),
    ("raw", "1, 2, 3, 4, 5,"),
    ("raw", "def fibonacci(n):"),
    ("raw", "Once upon a time, in a small village,"),
    ("raw", "The three primary colours are"),
    ("raw", "import numpy as np\n\nx = np."),
]


def build_requests(n: int, seed: int) -> list:
    """n requests (seeded): the warm-up first (every mode and draft at the longest prompt and length:
    the KV cache and compute buffers reach their largest size), then every CONTROL_EVERY-th is the
    control prompt and the rest are random."""
    from pipeinfer_cli.runtime.job import Request

    rng = random.Random(seed)
    longest = max(PROMPTS, key=lambda p: len(p[1]))[1]
    out = [Request(mode=m, chat=[{"role": "user", "content": longest}], label="warmup", n_predict=N_MAX, lookup_only=d)
           for m in MODES for d in (False, True)]
    n_warm = len(out)
    for i in range(n_warm, n):
        if (i - n_warm) % CONTROL_EVERY == 0:
            k = (i - n_warm) // CONTROL_EVERY
            out.append(Request(mode=MODES[k % 3], chat=[{"role": "user", "content": CONTROL}], label="control",
                               n_predict=CONTROL_N, lookup_only=bool(k % 2)))
            continue
        kind, text = rng.choice(PROMPTS)
        mode = rng.choice(MODES)
        req = Request(mode=mode, label=f"r{i}", n_predict=rng.randint(1, N_MAX),
                      lookup_only=rng.choice([False, True]), stop=["\n\n"] if rng.random() < 0.2 else [])
        if kind == "chat":
            req.chat = [{"role": "user", "content": text}]
        else:
            req.prompt = text
        out.append(req)
    return out


def job_config(model: Path, seed: int):
    from pipeinfer_cli.decode.draft_spec import DraftSpec
    from pipeinfer_cli.runtime.job import JobConfig
    from pipeinfer_cli.decode.sampling import SamplingParams
    from pipeinfer_cli.decode.session import DecodeOptions

    return JobConfig(model_path=model, model_label="smollm2-135m-instruct", draft_path=model,
                     draft=DraftSpec.parse("smollm2-135m-instruct"),
                     sampling=SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.0, seed=seed),
                     decode=DecodeOptions(n_predict=32, n_draft=4, p_accept=0.3, p_split=0.1, max_branches=3,
                                          max_inflight=4),
                     n_ctx=1024, threads="1")


def record_of(i: int, res) -> dict:
    """What the checks need of one request's result (a GenerationResult; its trace events are dropped: memory)."""
    ranks = []
    for r in res.ranks:
        r.trace = None
        ranks.append({"rank": r.rank, "kv_used_cells": r.kv_used_cells,
                      "kv_used_cells_at_start": r.kv_used_cells_at_start, **r.process.as_dict()})
    return {"i": i, "label": res.prompt_id, "mode": res.mode, "n_prompt": res.n_prompt,
            "n_gen": res.n_gen, "tokens": res.tokens, "ranks": ranks,
            "cancelled": res.runs.cancelled, "branches": res.runs.branches_launched}


def serve(args) -> None:
    """Inside the MPI job (every rank): run the requests; the head writes the records."""
    from pipeinfer_cli.runtime.job import run_job

    requests = build_requests(args.requests, args.seed)
    records: list[dict] = []
    t0 = time.monotonic()

    def on_result(res) -> None:
        records.append(record_of(len(records), res))
        res.ranks, res.tokens, res.text = [], [], ""  # run_job keeps every result until the end: keep it from counting as the head's growth
        n = len(records)
        if n % 50 == 0 or n == len(requests):
            print(f"soak: {n}/{len(requests)} requests, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)

    results = run_job(job_config(Path(args.model), args.seed), requests, on_result=on_result)
    if results is not None:
        results.clear()
        Path(args.records).write_text(json.dumps(records))


def check(records: list[dict]) -> tuple[dict, list[str]]:
    """The soak's figures and the list of failed checks."""
    problems = []
    extra: dict[str, int] = {}  # mode -> most KV cells beyond prompt + generated tokens at a request's end
    n_warm = max(sum(rec["label"] == "warmup" for rec in records) + 1, int(len(records) * WARMUP_FRACTION),
                 min(WARMUP_MIN, len(records) // 2))
    for rec in records:
        for r in rec["ranks"]:
            if r["kv_used_cells_at_start"] not in (None, 0):
                problems.append(f"request {rec['i']}: rank {r['rank']} started with {r['kv_used_cells_at_start']} KV cells in use")
            if r["kv_used_cells"] is not None:  # a figure, not a check: the clear before the next request frees them
                extra[rec["mode"]] = max(extra.get(rec["mode"], 0), r["kv_used_cells"] - rec["n_prompt"] - rec["n_gen"])
    per_rank = {}
    for rank in sorted({r["rank"] for r in records[0]["ranks"]}):
        series = [next(r for r in rec["ranks"] if r["rank"] == rank) for rec in records]
        base, after = series[n_warm - 1], series[n_warm:] or series[-1:]
        rss_max = max(s["rss_mib"] for s in after)
        growth = rss_max / base["rss_mib"] - 1
        fig = {"rss_mib_warm": base["rss_mib"], "rss_mib_max_after": rss_max, "rss_mib_end": series[-1]["rss_mib"],
               "rss_growth_pct": round(100 * growth, 2), "fds_warm": base["fds"], "fds_max_after": max(s["fds"] for s in after),
               "threads_warm": base["threads"], "threads_max_after": max(s["threads"] for s in after)}
        per_rank[rank] = fig
        if growth >= RSS_GROWTH_MAX:
            problems.append(f"rank {rank}: resident memory grew {100 * growth:.1f} % after warm-up")
        for what in ("fds", "threads"):
            if fig[f"{what}_max_after"] > fig[f"{what}_warm"]:
                problems.append(f"rank {rank}: {what} grew from {fig[f'{what}_warm']} to {fig[f'{what}_max_after']}")
    controls = [rec for rec in records if rec["label"] == "control"]
    variants = {tuple(rec["tokens"]) for rec in controls}
    if len(variants) > 1:
        problems.append(f"the control prompt gave {len(variants)} different token sequences")
    figures = {"requests": len(records), "warmup_requests": n_warm,
               "modes": {m: sum(rec["mode"] == m for rec in records) for m in MODES},
               "tokens_generated": sum(rec["n_gen"] for rec in records),
               "runs_cancelled": sum(rec["cancelled"] for rec in records),
               "tree_branches": sum(rec["branches"] for rec in records),
               "control_runs": len(controls), "control_variants": len(variants), "ranks": per_rank,
               "kv_cells_beyond_tokens_at_end": extra}
    return figures, problems


def report(figures: dict) -> str:
    lines = [f"{figures['requests']} requests ({', '.join(f'{n} {m}' for m, n in figures['modes'].items())}), "
             f"{figures['tokens_generated']} tokens, {figures['runs_cancelled']} runs cancelled, "
             f"{figures['tree_branches']} tree branches; control prompt: {figures['control_runs']} runs, "
             f"{figures['control_variants']} token sequence(s); warm-up {figures['warmup_requests']} requests",
             "", "| rank | RSS after warm-up (MiB) | max after (MiB) | growth | fds warm / max | threads warm / max |",
             "|---|---|---|---|---|---|"]
    for rank, f in figures["ranks"].items():
        lines.append(f"| {rank} | {f['rss_mib_warm']} | {f['rss_mib_max_after']} | {f['rss_growth_pct']:+.2f} % | "
                     f"{f['fds_warm']} / {f['fds_max_after']} | {f['threads_warm']} / {f['threads_max_after']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--model", default=None, help="GGUF path (default: smollm2-135m-instruct from the cache)")
    ap.add_argument("--json", type=Path, help="write the figures and every request's record here")
    ap.add_argument("--records", help=argparse.SUPPRESS)  # inside the job: where the head writes
    args = ap.parse_args(argv)
    if args.records:
        serve(args)
        return 0
    from pipeinfer_cli.transport.launch import relaunch

    model = args.model or subprocess.check_output(
        [sys.executable, "-m", "pipeinfer_cli", "models", "path", "smollm2-135m-instruct"], text=True).strip()
    records_path = Path(args.json or "build/soak.json").with_suffix(".records.json")
    records_path.parent.mkdir(parents=True, exist_ok=True)
    job_args = ["--requests", str(args.requests), "--seed", str(args.seed), "--model", model, "--records", str(records_path)]
    t0 = time.monotonic()
    # Through the package's launcher: its signal handling, its one error line, nothing left behind.
    os.environ["OMP_WAIT_POLICY"] = "passive"
    if relaunch(args.ranks, job_args, program=[sys.executable, os.path.abspath(__file__)]) != 0:
        print("Error: the soak job failed", file=sys.stderr)
        return 1
    records = json.loads(records_path.read_text())
    figures, problems = check(records)
    figures["seconds"] = round(time.monotonic() - t0, 1)
    print(report(figures))
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "problems": problems, "records": records}))
    for p in problems[:20]:
        print(f"FAILED: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
