#!/usr/bin/env python3
"""Weights from the head, measured on the emulated cluster (scripts/emulate_cluster.py, as root).

For each host count and link rate, three jobs of `pipeinfer generate MODEL --ranks N --json`, one rank
per host, through the CLI as users run it:

- local:    every host has the model (one shared cache);
- streamed: the model is on the head's host only (a node-local cache per host, empty elsewhere):
            every other rank is sent its rank slice by the head;
- cached:   the same again: the hosts read the slices from their node caches.

Per rank it prints where the weights came from, the bytes received, the seconds to stream them and
to be ready (plan + weights + load), the rank's peak RSS while streaming and loading, its RSS once
loaded and its share of the weights; and per job the wall time of the command. Figures and JSON.

  sudo .venv/bin/python scripts/bench_weight_stream.py --model qwen2.5-coder-1.5b-instruct \\
      --hosts 2 3 --rates 100mbit 1gbit --json build/weight_stream.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from pipeinfer_cli.models.cache import cached_model_path  # noqa: E402
from pipeinfer_cli.models.registry import load_registry  # noqa: E402

EMU = [str(ROOT / "scripts" / "emulate-cluster.sh"), "--prefix", "wsb", "--subnet", "10.216.9.0/24"]
PIPEINFER = str(ROOT / ".venv" / "bin" / "pipeinfer")


def emu(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([*EMU, *args], capture_output=True, text=True, env=env, timeout=timeout)


def run_job(model: str, n: int, cache: Path, node_local: bool, n_predict: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPEINFER_", "PMI_", "HYDRA_"))}
    env["PIPEINFER_CACHE"] = str(cache)
    if node_local:
        env["PIPEINFER_EMU_NODE_LOCAL"] = str(cache)
    t0 = time.monotonic()
    r = emu("exec", "--", PIPEINFER, "generate", model, "-p", "Write a function that adds two numbers.",
            "-n", str(n_predict), "--ranks", str(n), "--threads", "1", "--json", "--no-pull", env=env)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"Error: the job failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    got = json.loads(r.stdout)
    ranks = []
    for rank in got["ranks"]:
        w = rank.get("weights") or {}
        ranks.append({"rank": rank["rank"], "layers": rank["layers"], "source": w.get("source"),
                      "bytes_received": w.get("bytes_received"), "stream_s": w.get("stream_s"),
                      "ready_s": w.get("load_s"), "peak_rss_mib_streamed": w.get("peak_rss_mib_streamed"),
                      "peak_rss_mib_loading": w.get("peak_rss_mib_loading"), "rss_mib_loaded": w.get("rss_mib_loaded"),
                      "weight_mib": round(w["weight_bytes"] / 2**20, 1) if w.get("weight_bytes") else None})
    return {"wall_s": round(wall, 2), "ttft_s": got["ttft_s"], "tokens": got["tokens"], "ranks": ranks}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="a registry model (pulled)")
    p.add_argument("--hosts", type=int, nargs="+", default=[2, 3])
    p.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"])
    p.add_argument("-n", type=int, default=8, help="tokens to generate per job")
    p.add_argument("--json", type=Path, help="write every figure here")
    a = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("Error: the emulated cluster needs root (network namespaces)")
    entry = load_registry().model(a.model)
    model_file = cached_model_path(entry)
    if not model_file.exists():
        raise SystemExit(f"Error: {a.model} is not downloaded; run `pipeinfer models pull {a.model}`")
    results = []
    with tempfile.TemporaryDirectory(prefix="pipeinfer-ws-") as tmp:
        cache = Path(tmp) / "cache"
        cache.mkdir()
        os.link(model_file, cache / model_file.name) if model_file.stat().st_dev == cache.stat().st_dev \
            else shutil.copy(model_file, cache / model_file.name)
        for n in a.hosts:
            for rate in a.rates:
                emu("down")
                up = emu("up", str(n), "--rate", rate)
                if up.returncode != 0:
                    raise SystemExit(f"Error: emulate-cluster up failed: {up.stderr.strip()}")
                try:
                    for k in range(1, n):
                        shutil.rmtree(f"{cache}.wsb-h{k}", ignore_errors=True)
                    for case, node_local in (("local", False), ("streamed", True), ("cached", True)):
                        res = run_job(a.model, n, cache, node_local, a.n)
                        res.update({"hosts": n, "rate": rate, "case": case})
                        results.append(res)
                        print_row(res)
                finally:
                    emu("down")
                    for k in range(1, n):
                        shutil.rmtree(f"{cache}.wsb-h{k}", ignore_errors=True)
    same = len({tuple(r["tokens"]) for r in results}) == 1
    print(f"tokens identical in every job: {'yes' if same else 'NO'}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"model": a.model, "model_bytes": entry.size, "results": results,
                                      "tokens_identical": same}, indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0 if same else 1


def print_row(res: dict) -> None:
    head = f"{res['hosts']} hosts {res['rate']:>7} {res['case']:<8} wall {res['wall_s']:6.1f} s"
    print(head)
    for r in res["ranks"]:
        mb = (r["bytes_received"] or 0) / 1e6
        print(f"    rank {r['rank']}: {r['source']:<6} {mb:7.1f} MB in {r['stream_s'] or 0:5.1f} s, ready {r['ready_s']:5.1f} s, "
              f"peak RSS streamed {r['peak_rss_mib_streamed'] or '-'} MiB, loading {r['peak_rss_mib_loading']} MiB, "
              f"loaded {r['rss_mib_loaded']} MiB (weights {r['weight_mib']} MiB)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
