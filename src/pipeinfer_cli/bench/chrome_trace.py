"""Chrome trace-event JSON of a benchmark (opens in https://ui.perfetto.dev and chrome://tracing).

Layout: one process track per rank (pid = tid = rank, named "rank R · role · layers a–b"), every
request of the job in run order on one timeline, in microseconds from the first request's start.
Each rank's perf_counter is moved onto the head's clock with the offset the job measured at start
(`clock_offset_s`), so a run's slices line up across ranks.

- one slice per run per stage: "decode rN" (one token, not speculative), "verify rN" (speculative
  batch), "prefill rN" (prompt chunk); args: run, n_tokens, speculative, cancelled, prompt, mode;
- "draft" slices where the draft model runs (the head, or the draft rank), "draft prefill" when it
  processes a request's prompt;
- on the head, an enclosing slice per request ("prompt · mode") with its headline metrics;
- instants: "cancel" (the head cancels runs), "commit" (tokens committed at the head), "skip" (a
  stage dropped a cancelled run before starting it).
"""

from __future__ import annotations

import json
from pathlib import Path

US = 1e6


def _stage_name(args: dict) -> str:
    spec, n = args.get("spec"), args.get("n_tokens", 1)
    kind = "verify" if spec else ("prefill" if n and n > 1 else "decode")
    return f"{kind} r{args.get('run')}" + (" ✗" if args.get("cancelled") else "")


def _rank_label(r: dict) -> str:
    label = f"rank {r['rank']} · {r['role']}"
    if r.get("layers"):
        label += f" · layers {r['layers'][0]}–{r['layers'][1] - 1}"
    return label + f" · {r.get('threads')} thr"


def _event(kind: str, name: str, t0: float, t1: float, args: dict, rank: int, offset: float, origin: float,
           ctx: dict) -> dict:
    ts = (t0 - offset - origin) * US
    if name == "stage":
        out_name = _stage_name(args)
        out_args = {"run": args.get("run"), "n_tokens": args.get("n_tokens"), "speculative": bool(args.get("spec")),
                    "cancelled": bool(args.get("cancelled")), **ctx}
    else:
        out_name = name
        if name == "draft" and args.get("prefill"):
            out_name = "draft prefill"
        elif name == "commit" and "n" in args:
            out_name = f"commit +{args['n']}"
        elif name in ("skip",) and "run" in args:
            out_name = f"skip r{args['run']}"
        elif name == "send" and "run" in args:
            out_name = f"send r{args['run']} → rank {args.get('to')} ({args.get('bytes', 0)} B)"
        out_args = {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in args.items()}, **ctx}
    ev = {"name": out_name, "cat": ctx["mode"], "pid": rank, "tid": rank, "ts": round(ts, 3), "args": out_args}
    if kind == "X":
        ev.update(ph="X", dur=round(max(t1 - t0, 0.0) * US, 3))
        if out_args.get("cancelled"):
            ev["cname"] = "terrible"
    else:
        ev.update(ph="i", s="t")
    return ev


def build_trace(records: list[dict], header: dict | None = None) -> dict:
    """The trace document for records (in run order) whose ranks carry trace events."""
    if not records:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    origin = min(r["t_start"] for r in records)
    for rec in records:  # a rank's event may start before the head's t_start (clock error): keep ts >= 0
        for r in rec["ranks"]:
            for e in r.get("trace") or ():
                origin = min(origin, e[2] - r.get("clock_offset_s", 0.0))
    events: list[dict] = []
    seen_ranks: dict[int, dict] = {}
    for rec in records:
        ctx = {"prompt": rec["prompt_id"], "mode": rec["mode"], "repeat": rec["repeat"], "warmup": rec["warmup"]}
        events.append({
            "name": f"{rec['prompt_id']} · {rec['mode']}" + (" (warmup)" if rec["warmup"] else ""),
            "cat": "request", "ph": "X", "pid": 0, "tid": 0,
            "ts": round((rec["t_start"] - origin) * US, 3), "dur": round((rec["t_end"] - rec["t_start"]) * US, 3),
            "args": {**ctx, "n_gen": rec["n_gen"], "tok_per_s": rec["tok_per_s"], "ttft_s": rec["ttft_s"],
                     "acceptance_rate": rec["acceptance"]["rate"], "runs_launched": rec["runs"]["launched"],
                     "runs_cancelled": rec["runs"]["cancelled"]},
        })
        for r in rec["ranks"]:
            seen_ranks.setdefault(r["rank"], r)
            off = r.get("clock_offset_s", 0.0)
            for kind, name, t0, t1, args in r.get("trace") or ():
                events.append(_event(kind, name, t0, t1, args or {}, r["rank"], off, origin, ctx))
    meta = []
    for rank, r in sorted(seen_ranks.items()):
        meta += [
            {"name": "process_name", "ph": "M", "pid": rank, "tid": rank, "args": {"name": _rank_label(r)}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": rank, "args": {"sort_index": rank}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": rank, "args": {"name": r["role"]}},
        ]
    events.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))  # parents before children at equal start
    doc = {"traceEvents": meta + events, "displayTimeUnit": "ms"}
    if header is not None:
        doc["otherData"] = {"generator": "pipeinfer bench", "header": json.dumps(header)}
    return doc


def write_trace(path: Path, records: list[dict], header: dict | None = None) -> None:
    path.write_text(json.dumps(build_trace(records, header)) + "\n")
