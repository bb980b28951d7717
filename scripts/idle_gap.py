#!/usr/bin/env python3
"""Does a core that waited compute slower? Two stages of one model in one process, token by token.

The first --split layers and the rest are two LayerEngines in this one process, evaluated one
after the other for each token, as a 2-stage `iterative` pipeline does. Blocks of tokens
alternate between three ways to spend a --gap between the stages (and after the second):
- back to back: no gap;
- sleep: time.sleep(gap), so the core goes idle, as a pipeline rank waiting for a message does;
- spin: a busy loop for the gap, so the core stays awake.
Only the two evals are timed. No MPI, no second process: if "sleep" computes slower than "back to
back", an idle gap slows the compute that follows it on this machine, whatever the pipeline does.

    python scripts/idle_gap.py qwen2.5-coder-1.5b-instruct --gap 0.025 --blocks 24
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_native import resolve_model  # noqa: E402 - a sibling script


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


WAYS = {"back to back": lambda s: None, "sleep": time.sleep, "spin": spin}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="registry name or GGUF path")
    ap.add_argument("--gap", type=float, default=0.025, help="seconds between the stages (default 0.025)")
    ap.add_argument("--split", type=int, default=None, help="layers of the first stage (default: 60 %%)")
    ap.add_argument("--blocks", type=int, default=24, help="blocks of --block tokens, ways alternated")
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    from pipeinfer_cli.errors import PipeinferError
    from pipeinfer_cli.native import LayerEngine

    try:
        path = resolve_model(a.model)
    except PipeinferError as exc:
        raise SystemExit(f"Error: {exc}") from None
    probe = LayerEngine(path, 0, 1, n_ctx=8)
    n_layer = probe.n_layer
    del probe
    split = a.split or round(0.6 * n_layer)
    n_ctx = a.blocks * a.block + 8
    first = LayerEngine(path, 0, split, n_ctx=n_ctx, n_threads=a.threads)
    second = LayerEngine(path, split, n_layer, n_ctx=n_ctx, n_threads=a.threads)
    spent = {k: [0.0, 0] for k in WAYS}
    tok, pos = 100, 0
    for blk in range(a.blocks):
        name = list(WAYS)[blk % len(WAYS)]
        wait = WAYS[name]
        for _ in range(a.block):
            p = np.array([pos], np.int32)
            t0 = time.perf_counter()
            h = first.eval(tokens=np.array([tok], np.int32), pos=p, seq_ids=[[0]])
            t1 = time.perf_counter()
            wait(a.gap)
            t2 = time.perf_counter()
            logits = second.eval(embd=h, pos=p, seq_ids=[[0]])
            t3 = time.perf_counter()
            wait(a.gap)
            spent[name][0] += (t1 - t0) + (t3 - t2)
            spent[name][1] += 1
            tok, pos = int(logits.argmax()), pos + 1
    base = spent["back to back"][0] / spent["back to back"][1]
    rows = []
    print(f"| gap between the stages ({a.gap * 1e3:g} ms) | tokens | compute ms/token | speed × back to back |")
    print("|---|---:|---:|---:|")
    for name, (t, n) in spent.items():
        per = t / n
        rows.append({"way": name, "tokens": n, "compute_ms_per_token": round(per * 1e3, 3),
                     "speed_vs_back_to_back": round(base / per, 4)})
        print(f"| {name} | {n} | {per * 1e3:.2f} | {base / per:.3f} |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"model": str(path), "split": split, "gap_s": a.gap, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
