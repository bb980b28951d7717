#!/usr/bin/env python3
"""Where each rank's time goes, per generated token: a `pipeinfer generate` job sampled by py-spy.

Starts the job, waits for the decode phase (--delay seconds), samples every rank process with
`py-spy record --native --idle` for --duration seconds, and sorts each sample by what the rank was
doing at that instant:

- compute   ggml computing the rank's layers (ggml_graph_compute and the kernels under it);
- graph     the native engine around it: building and allocating the graph, copying rows in and out;
- waiting   sleeping between probes for a message (the transport's backoff);
- mpi       inside MPI (probe, receive, send, progress);
- sampling  choosing tokens from logits (decode/sampling.py);
- python    everything else in the interpreter (bookkeeping, messages, drafting glue).

Only each rank's main thread counts (helper threads such as the stage's cancel listener are
reported apart). The per-token figures are the fractions times the job's mean time per token.
py-spy is in the `profile` extra: `pip install -e ".[profile]"`. Needs ptrace rights (root here).

    python -m benchmarks.profile_ranks qwen2.5-coder-1.5b-instruct --ranks 2 --threads 1 -M iterative --json build/profile.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.report import markdown_table, publish
from benchmarks.runner import pipeinfer

PROMPT = "Write a detailed, long technical essay on the history of compilers, with many sections."
CATEGORIES = ("compute", "graph", "waiting", "mpi", "sampling", "python")


def categorize(frames: list[str]) -> str:
    """The category of one sampled stack (outermost frame first)."""
    text = ";".join(frames)
    if "ggml_graph_compute" in text or "ggml_compute_forward" in text:
        return "compute"
    if "Backoff.idle" in text:
        return "waiting"
    if "MPI" in text or "mpi4py" in text or "Iprobe" in text:
        return "mpi"
    if "sampling.py" in text:
        return "sampling"
    if "LayerEngine" in text or "_native" in text or "ggml" in text:
        return "graph"
    return "python"


def read_profile(path: Path) -> tuple[collections.Counter, collections.Counter]:
    """(main-thread category counts, helper-thread category counts) of a py-spy raw profile."""
    main, helpers = collections.Counter(), collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        # py-spy's raw format starts each stack with the thread: "thread (0x...)" or the process name.
        is_helper = any(x.startswith(("Thread._bootstrap", "CancelListener", "_Background")) for x in frames[:4])
        (helpers if is_helper else main)[categorize(frames)] += int(n)
    return main, helpers


def rank_pids(job: subprocess.Popen, n: int, timeout: float = 60.0) -> list[int]:
    """The pids of the job's rank processes (python -m pipeinfer_cli under mpiexec), in rank order."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["pgrep", "-f", f"^{sys.executable} -m pipeinfer_cli"], capture_output=True, text=True)
        pids = sorted(int(p) for p in out.stdout.split())
        if len(pids) >= n or (n == 1 and job.poll() is None and not pids):
            return pids[:n] if pids else [job.pid]
        time.sleep(0.2)
    raise SystemExit("Error: the job's rank processes did not appear within 60 s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--delay", type=float, default=12.0, help="seconds before sampling (load + prefill)")
    ap.add_argument("--duration", type=int, default=8)
    ap.add_argument("--rate", type=int, default=200, help="samples per second")
    ap.add_argument("--json", type=Path, required=True)
    a, job_args = ap.parse_known_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit('Error: py-spy is not installed; run: pip install -e ".[profile]"')
    cmd = pipeinfer("generate", a.model, "--ranks", a.ranks, "-n", 400, "-p", PROMPT, "--json", *job_args)
    out_dir = a.json.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    time.sleep(a.delay)  # the ranks load and prefill; found afterwards, once exec'd for good
    pids = rank_pids(job, a.ranks)
    spies = [subprocess.Popen([py_spy, "record", "--native", "--idle", "-r", str(a.rate), "-d", str(int(a.duration)),
                               "-p", str(pid), "-f", "raw", "-o", str(out_dir / f"profile_rank{r}.txt")],
                              stdout=subprocess.DEVNULL, stderr=open(out_dir / f"py-spy_rank{r}.log", "w")) for r, pid in enumerate(pids)]
    for s in spies:
        s.wait()
    stdout, _ = job.communicate()
    if job.returncode != 0:
        raise SystemExit(f"Error: the job failed (exit {job.returncode}): {' '.join(cmd)}")
    result = json.loads(stdout)
    ms_per_token = 1e3 / result["decode_tok_per_s"]
    ranks = []
    for r in range(len(pids)):
        main_c, helper_c = read_profile(out_dir / f"profile_rank{r}.txt")
        total = sum(main_c.values()) or 1
        ranks.append({"rank": r, "samples": total,
                      "fraction": {c: main_c[c] / total for c in CATEGORIES},
                      "ms_per_token": {c: ms_per_token * main_c[c] / total for c in CATEGORIES},
                      "helper_threads_samples": dict(helper_c)})
    doc = {"command": " ".join(cmd), "decode_tok_per_s": result["decode_tok_per_s"], "ms_per_token": ms_per_token,
           "layer_split": result.get("layer_split"), "ranks": ranks}
    publish(markdown_table(["rank", *CATEGORIES], [[str(rk["rank"])] + [f"{rk['ms_per_token'][c]:.1f} ms "
                                                 f"({100 * rk['fraction'][c]:.0f} %)" for c in CATEGORIES] for rk in ranks]),
            doc, a.json, notes=[f"decode {result['decode_tok_per_s']:.2f} tok/s = {ms_per_token:.1f} ms per token; "
                                f"`{' '.join(cmd[1:])}`"])
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
