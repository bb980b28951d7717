#!/usr/bin/env python3
"""llama.cpp's `llama-server -np P` against `pipeinfer serve --parallel P`, with the same load.

The same closed-loop load (bench --concurrency's: AsyncOpenAI clients on asyncio, streaming, C
requests in flight at every level) goes to llama.cpp's own server on all the cores (`-t 2`,
continuous batching, its defaults otherwise) and to `pipeinfer serve` on 2 ranks x 1 thread on the
same cores; the table gives aggregate tok/s and p50/p99 TTFT and ITL per level.

llama-server is not a dependency: build it from the llama.cpp tree that the llama-cpp-python sdist
carries (`pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36`, then `cmake -B build
-DCMAKE_BUILD_TYPE=Release && cmake --build build --target llama-server`) and pass its path.

    .venv/bin/python scripts/bench_vs_llama_server.py qwen2.5-coder-0.5b-instruct \\
        --llama-server /path/to/llama-server --parallel 2 --levels 1,2,4 --limit 8 -n 64 \\
        --pipeinfer-split 0.65,0.35 --json build/vs-llama-server.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from pipeinfer_cli.bench import concurrency as cc
from pipeinfer_cli.bench.prompts import load_prompts, resolve_prompts
from pipeinfer_cli.models.model_files import resolve_model
from pipeinfer_cli.models.registry import load_registry


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server_load(args, path: str, prompts, levels: list[int]) -> list[dict]:
    port = free_port()
    cmd = [args.llama_server, "-m", path, "-np", str(args.parallel), "-c", str(args.ctx), "-t", str(args.threads),
           "--host", "127.0.0.1", "--port", str(port)]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"llama-server did not start; see {log.name}")
            time.sleep(0.2)
        sampling = cc.Sampling(n_predict=args.n_predict, temperature=0.0, seed=0, top_k=40, top_p=0.95, min_p=0.05)
        load = asyncio.run(cc.run_load(f"http://127.0.0.1:{port}/v1", prompts, ["llama-server"], levels, 1, 1, sampling))
        cc.check_identical(load.records)  # marks each record: its text against its text at level 1
        return cc.summarize(load.records, ["llama-server"], levels, load.walls, load.peaks)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def pipeinfer_load(args, levels: list[int]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "load.json"
        cmd = [sys.executable, "-m", "pipeinfer_cli", "bench", args.model, "--modes", "iterative", "--concurrency",
               ",".join(map(str, levels)), "--parallel", str(args.parallel), "--limit", str(args.limit), "-n",
               str(args.n_predict), "--ranks", "2", "--threads", "1,1", "--ctx", str(args.ctx), "--json", str(out)]
        if args.pipeinfer_split:
            cmd += ["--layer-split", args.pipeinfer_split]
        print("+ pipeinfer " + " ".join(cmd[3:]), file=sys.stderr, flush=True)
        if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:
            sys.exit("pipeinfer bench failed")
        return json.loads(out.read_text())["summary"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--llama-server", required=True, help="path to llama.cpp's llama-server binary")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--levels", default="1,2,4")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2, help="llama-server's -t (all the cores pipeinfer's ranks use)")
    ap.add_argument("--pipeinfer-split", help="pipeinfer's --layer-split on its 2 ranks")
    ap.add_argument("--json")
    args = ap.parse_args()
    levels = sorted({1, *(int(x) for x in args.levels.split(","))})
    path = str(resolve_model(args.model, load_registry()).path)
    prompts = load_prompts(resolve_prompts("default"), args.limit)
    llama = {r["concurrency"]: r for r in llama_server_load(args, path, prompts, levels)}
    ours = {r["concurrency"]: r for r in pipeinfer_load(args, levels)}
    rows = []
    for c in levels:
        a, b = llama[c], ours[c]
        keys = ("tok_per_s", "ttft_ms", "itl_ms", "mismatched_prompts")
        rows.append({"concurrency": c, "llama_server": {k: a[k] for k in keys}, "pipeinfer": {k: b[k] for k in keys}})
        print(f"C={c}: llama-server -np {args.parallel} -t {args.threads}: {a['tok_per_s']:.1f} tok/s, TTFT p50 "
              f"{a['ttft_ms']['p50']:.0f} ms, ITL p50/p99 {a['itl_ms']['p50']:.1f}/{a['itl_ms']['p99']:.1f} ms, "
              f"{len(a['mismatched_prompts'])} texts not as at level 1 | "
              f"pipeinfer serve --parallel {args.parallel}, 2 ranks x 1 thread: {b['tok_per_s']:.1f} tok/s, TTFT p50 "
              f"{b['ttft_ms']['p50']:.0f} ms, ITL p50/p99 {b['itl_ms']['p50']:.1f}/{b['itl_ms']['p99']:.1f} ms, "
              f"{len(b['mismatched_prompts'])} not as at level 1",
              flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": args.model, "parallel": args.parallel, "threads": args.threads,
                                               "limit": args.limit, "n_predict": args.n_predict, "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
