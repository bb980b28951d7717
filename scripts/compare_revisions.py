#!/usr/bin/env python3
"""An older revision of pipeinfer against this checkout, through the CLI, interleaved in one run.

The older revision is checked out into a temporary git worktree and run with the same venv and
the same native extension (copied from this checkout: pass --old only for revisions whose
extension's API is the same). For every case (model, mode, ranks, sampling), old and new
alternate `--repeat` times; each run is `python -m pipeinfer_cli generate … --json`. Prints, per
case, whether the tokens are identical and the decode tok/s of each side (median), then the
ratio new/old; --json prints every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Here is a Python function that checks whether a number is prime:\n\ndef is_prime(n):"

# (label, model, extra args): each case runs with greedy sampling and with a seeded temperature.
CASES = [
    ("iterative 1 rank", "smollm2-135m-instruct", ["-M", "iterative", "--threads", "2"]),
    ("iterative 2 ranks", "smollm2-135m-instruct", ["-M", "iterative", "--ranks", "2", "--threads", "1"]),
    ("speculative 2 ranks", "smollm2-135m-instruct",
     ["-M", "speculative", "--draft", "smollm2-135m-instruct", "--ranks", "2", "--threads", "1"]),
    ("pipeinfer 2 ranks, lookup", "smollm2-135m-instruct",
     ["-M", "pipeinfer", "--draft", "lookup", "--ranks", "2", "--threads", "1"]),
    ("pipeinfer 3 ranks", "smollm2-135m-instruct",
     ["-M", "pipeinfer", "--draft", "smollm2-135m-instruct", "--ranks", "3", "--threads", "1"]),
    ("pipeinfer 1/1 (draft rank)", "smollm2-135m-instruct",
     ["-M", "pipeinfer", "--draft", "smollm2-135m-instruct", "--layer-split", "1/1", "--threads", "1"]),
]
QWEN_CASES = [
    ("qwen iterative 2 ranks", "qwen2.5-coder-1.5b-instruct", ["-M", "iterative", "--ranks", "2", "--threads", "1"]),
    ("qwen pipeinfer 2 ranks", "qwen-coder", ["-M", "pipeinfer", "--ranks", "2", "--threads", "1"]),
    ("qwen speculative 1 rank", "qwen-coder", ["-M", "speculative", "--threads", "2"]),
]
SAMPLINGS = {"greedy": [], "temp0.8-seed7": ["--temp", "0.8", "--seed", "7"]}


def worktree(rev: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(where), rev], check=True)
    for so in (ROOT / "src" / "pipeinfer_cli").glob("_native*.so"):
        shutil.copy2(so, where / "src" / "pipeinfer_cli" / so.name)
    return where


def run(src: Path, model: str, args: list[str], n: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "PIPEINFER_NO_PULL": "1"}
    r = subprocess.run([sys.executable, "-m", "pipeinfer_cli", "generate", model, "-p", PROMPT, "-n", str(n),
                        "--json", *args], capture_output=True, text=True, env=env, cwd=src.parent)
    if r.returncode != 0:
        raise SystemExit(f"Error: {src}: generate {model} {' '.join(args)} failed: {r.stderr.strip()[-400:]}")
    out = json.loads(r.stdout)
    return {"tokens": out["tokens"], "decode_tok_per_s": out["decode_tok_per_s"]}


def _median(values: list) -> float | None:
    """Median decode tok/s, None when no run decoded more than one token."""
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 2) if known else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default="a960e2c", help="the older revision (default a960e2c)")
    ap.add_argument("--repeat", type=int, default=2, help="old/new pairs per case (default 2)")
    ap.add_argument("-n", type=int, default=64, help="tokens per run (default 64)")
    ap.add_argument("--qwen", action="store_true", help="also the Qwen pair (must be pulled)")
    ap.add_argument("--only", default="", help="only the cases whose label contains this text")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    cases = [c for c in CASES + (QWEN_CASES if a.qwen else []) if a.only in c[0]]
    rows = []
    with tempfile.TemporaryDirectory(prefix="pipeinfer-old-") as tmp:
        old = worktree(a.old, Path(tmp) / "old")
        try:
            for label, model, args in cases:
                for sname, sargs in SAMPLINGS.items():
                    runs = {"old": [], "new": []}
                    for _ in range(a.repeat):
                        runs["old"].append(run(old / "src", model, args + sargs, a.n))
                        runs["new"].append(run(ROOT / "src", model, args + sargs, a.n))
                    same = all(r["tokens"] == runs["old"][0]["tokens"] for side in runs.values() for r in side)
                    med = {k: _median([r["decode_tok_per_s"] for r in v]) for k, v in runs.items()}
                    ratio = round(med["new"] / med["old"], 3) if med["old"] and med["new"] else None
                    rows.append({"case": label, "sampling": sname, "identical_tokens": same,
                                 "n_gen": len(runs["new"][0]["tokens"]), "old_tok_per_s": med["old"],
                                 "new_tok_per_s": med["new"], "ratio": ratio, "runs": runs})
                    print(f"{label:30} {sname:14} tokens {'identical' if same else 'DIFFER'}  "
                          f"old {med['old']}  new {med['new']}  new/old {ratio}", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    if a.json:
        print(json.dumps({"old": a.old, "rows": rows}))
        return
    print("| case | sampling | tokens generated | tokens | old decode tok/s | new decode tok/s | new/old |")
    print("|---|---|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['sampling']} | {r['n_gen']} | {'identical' if r['identical_tokens'] else '**differ**'} | "
              f"{r['old_tok_per_s'] or '-'} | {r['new_tok_per_s'] or '-'} | {r['ratio'] or '-'} |")
    bad = [r for r in rows if not r["identical_tokens"]]
    if bad:
        raise SystemExit(f"Error: tokens differ in {len(bad)} case(s)")


if __name__ == "__main__":
    main()
