#!/usr/bin/env python3
"""Split each request's wall time into the layers' compute and everything else, per configuration.

Reads the JSON of `scripts/bench_topologies.py --suite overhead` (one or several files) and prints,
per configuration, over the measured requests:
- compute: the ggml compute time of every rank's layer evaluations, summed over the ranks (in
  `iterative` mode only one stage computes at a time, so the sum is on the critical path);
- the rest: wall time minus that sum (hand-offs, waiting beyond the other stage's compute, MPI,
  sampling, Python), as a share of wall time and in ms per run;
- paired with the reference configuration (the first, or --reference), per prompt and round: the
  speed ratio (reference wall / this wall) and the compute ratio (reference compute / this compute).
  When the compute ratio explains the speed ratio, the gap is in how fast the layers computed, not
  in the pipeline.

    python scripts/pipeline_overhead.py build/bench_overhead.json [more.json ...]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from core_budget import requests_of  # noqa: E402 - a sibling script


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def split(rec: dict) -> dict:
    wall = rec["t_end"] - rec["t_start"]
    compute = sum(r["engine"]["t_compute_us"] for r in rec["ranks"]) / 1e6
    runs = max(rec["ranks"][0].get("runs", rec["n_gen"]), 1)
    return {"wall": wall, "compute": compute, "rest_share": (wall - compute) / wall,
            "rest_ms_per_run": (wall - compute) * 1e3 / runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", type=Path)
    ap.add_argument("--reference", default=None, help="configuration label to pair with (default: the first)")
    a = ap.parse_args()
    rows: dict[str, dict[tuple, dict]] = {}  # label -> (file, round, prompt) -> split
    order: list[str] = []
    for path in a.json:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"Error: cannot read {path}: {exc}; give the JSON of scripts/bench_topologies.py") from None
        for run in doc.get("runs", []):
            label = run["label"]
            if label not in rows:
                rows[label] = {}
                order.append(label)
            for _, rec in requests_of({"runs": [run]}):
                rows[label][(str(path), run["round"], rec["prompt_id"])] = split(rec)
    if not order:
        raise SystemExit("Error: no runs in these files; give the JSON of scripts/bench_topologies.py")
    ref = a.reference or order[0]
    if ref not in rows:
        raise SystemExit(f"Error: --reference {ref!r} is not a configuration of these files")
    print(f"| configuration | requests | the rest, share of wall time (median, range) | rest ms per run | "
          f"× {ref}: speed (geomean, range) | × {ref}: compute |")
    print("|---|---:|---|---:|---:|---:|")
    for label in order:
        got = rows[label]
        shares = [s["rest_share"] for s in got.values()]
        per_run = statistics.median(s["rest_ms_per_run"] for s in got.values())
        pairs = [(rows[ref][k], s) for k, s in got.items() if k in rows[ref]]
        speed = [r["wall"] / s["wall"] for r, s in pairs]
        comp = [r["compute"] / s["compute"] for r, s in pairs]
        paired = (f"{geomean(speed):.3f} ({min(speed):.2f}–{max(speed):.2f}) | {geomean(comp):.3f} "
                  f"({min(comp):.2f}–{max(comp):.2f})") if pairs else "– | –"
        print(f"| {label} | {len(got)} | {100 * statistics.median(shares):.2f} % ({100 * min(shares):.2f}–"
              f"{100 * max(shares):.2f} %) | {per_run:.2f} | {paired} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
