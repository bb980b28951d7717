"""`--layer-split auto` against the byte-balanced default, through the CLI as users run it, on
equal ranks and on ranks made unequal with PIPEINFER_DEBUG_SLOW (a rank that computes FACTOR
times as slowly, sleeping the difference). Per scenario: `pipeinfer calibrate` under the same
environment, then `pipeinfer bench` with the default split and with `--layer-split auto`,
alternated for --rounds rounds; prints tok/s per run and the ratio auto / default (geometric mean
over rounds and prompts), and JSON with --json.

    python scripts/bench_auto_split.py --rounds 2 --json auto_split.json

Run nothing else meanwhile: the figures are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPEINFER = [sys.executable, "-m", "pipeinfer_cli"]
SCENARIOS = {"equal": {}, "rank1-2x-slower": {"PIPEINFER_DEBUG_SLOW": "1:2"}}


def run(cmd: list[str], env: dict) -> str:
    print("+", " ".join(f"{k}={v}" for k, v in env.items()), " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env})
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return r.stdout


def bench(model: str, args, env: dict, extra: list[str], out: Path) -> dict:
    run(PIPEINFER + ["bench", model, "--ranks", "2", "--modes", args.modes, "--prompts", args.prompts, "--limit",
                     str(args.limit), "-n", str(args.n), "--warmup", "0", "--json", str(out), *extra], env)
    d = json.loads(out.read_text())
    return {"split": d["records"][0]["layer_split"],
            "tok_per_s": {(r["mode"], r["prompt_id"]): r["tok_per_s"] for r in d["records"] if not r["warmup"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--modes", default="iterative")
    ap.add_argument("--prompts", default="default")
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, env in SCENARIOS.items():
            prof = work / f"{name}.profile.json"
            run(PIPEINFER + ["calibrate", args.model, "--ranks", "2", "--quick", "--out", str(prof)], env)
            runs = {"default": [], "auto": []}
            for i in range(args.rounds):
                order = ["default", "auto"] if i % 2 == 0 else ["auto", "default"]
                for which in order:
                    extra = ["--layer-split", "auto", "--profile", str(prof)] if which == "auto" else []
                    runs[which].append(bench(args.model, args, env, extra, work / f"{name}-{which}-{i}.json"))
            ratios = [a["tok_per_s"][k] / d["tok_per_s"][k] for a, d in zip(runs["auto"], runs["default"])
                      for k in d["tok_per_s"] if a["tok_per_s"].get(k) and d["tok_per_s"][k]]
            results[name] = {"splits": {w: runs[w][0]["split"] for w in runs},
                             "tok_per_s": {w: [statistics.median(r["tok_per_s"].values()) for r in runs[w]] for w in runs},
                             "auto_over_default": math.exp(statistics.fmean(math.log(x) for x in ratios)),
                             "ratio_range": [min(ratios), max(ratios)]}
            r = results[name]
            print(f"{name:16} default {r['splits']['default']:>14} {r['tok_per_s']['default']}  auto {r['splits']['auto']:>14} "
                  f"{r['tok_per_s']['auto']}  auto/default {r['auto_over_default']:.3f} "
                  f"({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
