#!/usr/bin/env python3
"""`serve --parallel` against today's FIFO server (`--parallel 1`), through `pipeinfer bench --concurrency`.

For each topology (ranks x threads) and mode, one FIFO server and one parallel server (P = the
largest level) are loaded with the same closed-loop requests at every level (AsyncOpenAI clients,
streaming); the table gives aggregate tok/s of both, their ratio, and p50/p99 TTFT and ITL.
Every text must equal its level-1 text (bench checks it and exits 1 otherwise). With --policies,
pipeinfer mode is also run with each --load-policy at the levels given.

    .venv/bin/python scripts/bench_parallel.py qwen2.5-coder-0.5b-instruct --draft lookup \\
        --ranks 2 3 --levels 1,2,4,8 --limit 8 -n 64 --json build/parallel.json
    .venv/bin/python scripts/bench_parallel.py qwen2.5-coder-0.5b-instruct --draft lookup \\
        --ranks 2 3 --levels 1,2 --modes pipeinfer --policies --limit 8 -n 64 --json build/policies.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

POLICIES = ("yield", "round-robin", "no-spec")


def run_bench(model: str, args, ranks: int, mode: str, parallel: int, policy: str | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "load.json"
        cmd = [sys.executable, "-m", "pipeinfer_cli", "bench", model, "--modes", mode, "--concurrency", args.levels,
               "--parallel", str(parallel), "--limit", str(args.limit), "-n", str(args.n_predict),
               "--ranks", str(ranks), "--threads", ",".join(["1"] * ranks), "--ctx", str(args.ctx),
               "--json", str(out)]
        if args.draft and mode != "iterative":
            cmd += ["--draft", args.draft]
        if policy is not None:
            cmd += ["--load-policy", policy]
        if args.prompts:
            cmd += ["--prompts", args.prompts]
        if ranks in args.layer_split:
            cmd += ["--layer-split", args.layer_split[ranks]]
        print("+ pipeinfer " + " ".join(cmd[3:]), file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            sys.exit(f"bench failed ({proc.returncode}): {' '.join(cmd)}")
        return json.loads(out.read_text())


def rows_of(doc: dict) -> dict[int, dict]:
    return {s["concurrency"]: s for s in doc["summary"]}


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--draft", default="lookup")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--modes", default="iterative,pipeinfer")
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--prompts", help="bench's --prompts (default: its default set)")
    ap.add_argument("--split", action="append", default=[], metavar="RANKS=SPLIT",
                    help="--layer-split for a rank count, e.g. 2=0.65,0.35 (default: pipeinfer's)")
    ap.add_argument("--policies", action="store_true", help="compare the load policies (parallel server only)")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.layer_split = {int(k): v for k, v in (x.split("=", 1) for x in args.split)}
    p_max = max(int(x) for x in args.levels.split(","))
    results = []
    for ranks in args.ranks:
        for mode in args.modes.split(","):
            if args.policies:
                runs = {pol: rows_of(run_bench(args.model, args, ranks, mode, p_max, pol)) for pol in POLICIES}
                for level in sorted(runs["yield"]):
                    row = {"ranks": ranks, "mode": mode, "concurrency": level}
                    for pol in POLICIES:
                        r = runs[pol][level]
                        row[pol] = {"tok_per_s": r["tok_per_s"], "ttft_ms": r["ttft_ms"], "itl_ms": r["itl_ms"]}
                    results.append(row)
                    print(f"{ranks} ranks {mode:<10} C={level}: " + ", ".join(
                        f"{pol} {fmt(row[pol]['tok_per_s'])} tok/s" for pol in POLICIES), flush=True)
                continue
            fifo = rows_of(run_bench(args.model, args, ranks, mode, 1, None))
            par = rows_of(run_bench(args.model, args, ranks, mode, p_max, None))
            for level in sorted(fifo):
                f, p = fifo[level], par[level]
                row = {"ranks": ranks, "mode": mode, "concurrency": level,
                       "fifo": {k: f[k] for k in ("tok_per_s", "ttft_ms", "itl_ms")},
                       "parallel": {k: p[k] for k in ("tok_per_s", "ttft_ms", "itl_ms")},
                       "ratio": round(p["tok_per_s"] / f["tok_per_s"], 2) if f["tok_per_s"] else None}
                results.append(row)
                print(f"{ranks} ranks {mode:<10} C={level}: FIFO {fmt(f['tok_per_s'])} tok/s, parallel "
                      f"{fmt(p['tok_per_s'])} tok/s ({fmt(row['ratio'], '.2f')}x); TTFT p50/p99 "
                      f"{fmt(f['ttft_ms']['p50'], '.0f')}/{fmt(f['ttft_ms']['p99'], '.0f')} vs "
                      f"{fmt(p['ttft_ms']['p50'], '.0f')}/{fmt(p['ttft_ms']['p99'], '.0f')} ms; ITL p50/p99 "
                      f"{fmt(f['itl_ms']['p50'])}/{fmt(f['itl_ms']['p99'])} vs "
                      f"{fmt(p['itl_ms']['p50'])}/{fmt(p['itl_ms']['p99'])} ms", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": args.model, "draft": args.draft, "levels": args.levels,
                                               "limit": args.limit, "n_predict": args.n_predict, "rows": results},
                                              indent=1))


if __name__ == "__main__":
    main()
