#!/usr/bin/env python3
"""Core-milliseconds per committed token, per topology and mode, from benchmark JSON.

Reads the JSON of `scripts/bench_topologies.py` (or of `pipeinfer bench --json`) and prints, for
each configuration and mode, medians over the measured requests of:
- wall ms per token: the request's wall time (first token included) / tokens generated;
- CPU ms per token, summed over the job's ranks (each rank's process CPU time during the request:
  compute, drafting, sampling, waiting, MPI), and split head / stages / draft rank;
- cores busy: summed CPU time / wall time (what the job got out of the machine);
- the bound: cores × 1000 / CPU ms per token, the tok/s the job would reach if the same work kept
  every core busy. A mode whose bound is below another's measured tok/s cannot catch it by
  scheduling alone: it computes too much per committed token.

    python scripts/core_budget.py build/bench_topologies_default.json [--cores 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path


def requests_of(doc: dict) -> list[tuple[str, dict]]:
    """(configuration label, record) of every measured pipeinfer request in a document."""
    if "runs" in doc:  # bench_topologies.py: one bench document per run
        return [(run["label"], r) for run in doc["runs"] for r in (run.get("doc") or {}).get("records", [])
                if "ranks" in r and not r.get("warmup")]
    label = (doc.get("header") or {}).get("topology", {}).get("layer_split", "job")
    return [(str(label), r) for r in doc.get("records", []) if "ranks" in r and not r.get("warmup")]


def budget(rec: dict) -> dict:
    n = max(rec["n_gen"], 1)
    wall_ms = (rec["t_end"] - rec["t_start"]) * 1e3
    by_role: dict[str, float] = {}
    for rank in rec["ranks"]:
        by_role[rank["role"]] = by_role.get(rank["role"], 0.0) + rank["cpu_s"] * 1e3
    cpu_ms = sum(by_role.values())
    return {"wall_ms_per_token": wall_ms / n, "cpu_ms_per_token": cpu_ms / n,
            **{f"{role}_ms_per_token": ms / n for role, ms in by_role.items()},
            "cores_busy": cpu_ms / wall_ms if wall_ms > 0 else 0.0, "tok_per_s": rec["tok_per_s"]}


def summarize(pairs: list[tuple[str, dict]], cores: int) -> list[dict]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for label, rec in pairs:
        groups.setdefault((label, rec["mode"]), []).append(budget(rec))
    rows = []
    for (label, mode), bs in groups.items():
        med = {k: statistics.median(b[k] for b in bs if k in b) for k in bs[0]}
        med["bound_tok_per_s"] = cores * 1e3 / med["cpu_ms_per_token"]
        rows.append({"config": label, "mode": mode, "n": len(bs), **med})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| configuration | mode | tok/s | wall ms/token | CPU ms/token (head + stages + draft rank) "
             "| cores busy | bound tok/s |", "|---|---|---:|---:|---|---:|---:|"]
    for r in rows:
        parts = " + ".join(f"{r[k]:.0f}" for k in ("head_ms_per_token", "stage_ms_per_token", "draft_ms_per_token")
                           if k in r)
        lines.append(f"| {r['config']} | {r['mode']} | {r['tok_per_s']:.2f} | {r['wall_ms_per_token']:.1f} "
                     f"| {r['cpu_ms_per_token']:.1f} ({parts}) | {r['cores_busy']:.2f} | {r['bound_tok_per_s']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path, nargs="+")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores the jobs had (default: this machine's)")
    a = ap.parse_args(argv)
    pairs = []
    for path in a.json:
        try:
            pairs += requests_of(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            print(f"Error: {path}: {exc}", file=sys.stderr)
            return 2
    if not pairs:
        print("Error: no measured pipeinfer requests in the given files", file=sys.stderr)
        return 2
    print(table(summarize(pairs, a.cores)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
