"""`make fuzz`: the long campaign, every target in turn (or the ones named), with figures.

    .venv/bin/python fuzz/campaign.py [--runs 100000] [--max-time SECONDS] [TARGET...]

Each target runs fuzz/fuzz_gguf.py (libFuzzer) with -runs=RUNS, -timeout=5 (an input running
longer is a hang), -rss_limit_mb=3072 (a blow-up; the process also has a 4 GiB address-space
limit), its working corpus in build/fuzz/corpus/TARGET plus the committed seeds and regressions,
crash inputs in build/fuzz/artifacts/. The log of each target is build/fuzz/TARGET.log; the
figures (inputs, exec/s, coverage edges and features of the Python code, new corpus entries, crashes)
go to stdout and build/fuzz/summary.json (summary-TARGET.json when one target is named).
Exits 1 when a target found a crash, a hang or a blow-up.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import gguf_struct  # fuzz/ is on sys.path: this file is run as a script

FUZZ = Path(__file__).resolve().parent
ROOT = FUZZ.parent
OUT = ROOT / "build" / "fuzz"
SEEDS = [ROOT / "tests" / "fuzz_corpus" / "seeds", ROOT / "tests" / "fuzz_corpus" / "regressions"]
TARGETS = ("metadata", "native", "tokenizer")


def run_target(target: str, runs: int, max_time: int | None) -> dict:
    corpus = OUT / "corpus" / target
    artifacts = OUT / "artifacts"
    corpus.mkdir(parents=True, exist_ok=True)
    artifacts.mkdir(parents=True, exist_ok=True)
    log = OUT / f"{target}.log"
    cmd = [sys.executable, str(FUZZ / "fuzz_gguf.py"), target, f"-runs={runs}", "-timeout=5", "-rss_limit_mb=3072",
           f"-max_len={gguf_struct.MAX_INPUT}", "-print_final_stats=1", "-print_pcs=0", f"-artifact_prefix={artifacts}/{target}-",
           str(corpus), *map(str, SEEDS)]
    if max_time:
        cmd.insert(3, f"-max_total_time={max_time}")
    print(f"fuzz {target}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=OUT).returncode
    return summarize(target, log.read_text(errors="replace"), rc, time.monotonic() - t0)


def summarize(target: str, log: str, rc: int, seconds: float) -> dict:
    """The figures libFuzzer prints at the end (-print_final_stats) and what ended the run."""
    def stat(name: str) -> int:
        m = re.search(rf"stat::{name}:\s+(\d+)", log)
        return int(m.group(1)) if m else 0

    # The last status line: Python edges (atheris instruments bytecode; the C++ is not) and features.
    status = re.findall(r"^#\d+\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/", log, re.M)
    cov, ft, corp = map(int, status[-1]) if status else (0, 0, 0)
    written = re.findall(r"Test unit written to (\S+)", log)
    # libFuzzer also saves its slowest inputs ("slow-unit-": over 10 s of wall-clock time, which a
    # busy machine produces); only crash-, timeout- and oom- inputs are findings.
    crashes = [p for p in written if "/slow-unit-" not in Path(p).as_posix() and "slow-unit-" not in Path(p).name]
    interrupted = "run interrupted" in log
    kind = ("hang" if "ERROR: libFuzzer: timeout" in log else
            "memory blow-up" if "out-of-memory" in log or "MemoryError" in log else
            "crash" if crashes or (rc != 0 and not interrupted) else None)
    return {"target": target, "inputs": stat("number_of_executed_units"), "exec_per_s": stat("average_exec_per_sec"),
            "new_corpus_entries": stat("new_units_added"), "coverage_edges": cov, "features": ft, "corpus_size": corp,
            "peak_rss_mb": stat("peak_rss_mb"),
            "seconds": round(seconds), "finding": kind, "artifacts": crashes, "interrupted": interrupted,
            "slow_units": [p for p in written if p not in crashes], "exit_code": rc}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("targets", nargs="*", default=list(TARGETS))
    ap.add_argument("--runs", type=int, default=100_000, help="inputs per target (default 100000)")
    ap.add_argument("--max-time", type=int, default=None, help="stop a target after this many seconds")
    args = ap.parse_args()
    results = [run_target(t, args.runs, args.max_time) for t in args.targets]
    OUT.mkdir(parents=True, exist_ok=True)
    name = "summary.json" if tuple(args.targets) == TARGETS else f"summary-{'-'.join(args.targets)}.json"
    (OUT / name).write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'target':10} {'inputs':>8} {'exec/s':>7} {'cov':>5} {'ft':>6} {'new corpus':>10} {'peak RSS':>9} {'time':>7}  result")
    for r in results:
        result = "no crash, hang or blow-up" if r["finding"] is None else f"{r['finding']}: {' '.join(r['artifacts'])}"
        print(f"{r['target']:10} {r['inputs']:>8} {r['exec_per_s']:>7} {r['coverage_edges']:>5} {r['features']:>6} {r['new_corpus_entries']:>10} "
              f"{r['peak_rss_mb']:>7}MB {r['seconds']:>6}s  {result}")
    return 1 if any(r["finding"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
