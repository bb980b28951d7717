#!/usr/bin/env python3
"""CPU a waiting head burns while another rank is late to start, and what the start-up settings cost.

1. `--wait`: an MPMD job whose rank 1 starts LATE_S seconds after rank 0 (and then fails: its model
   cache is empty). Rank 0's CPU seconds over the wait are sampled from /proc, with MPICH's heavy
   yield as pipeinfer sets it (1) and turned off (0, as before the start-up fix: MPI_Init's
   sched_yield loop).
2. `--speed`: 2-rank `pipeinfer generate` (SmolLM2, lookup draft) with the heavy yield 0 and 1,
   interleaved, decode tok/s through the CLI: the setting must cost the running job nothing.

Prints a table and, with --json, one JSON object. Needs smollm2-135m-instruct pulled.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
PIPEINFER, MPIEXEC = str(BIN / "pipeinfer"), str(BIN / "mpiexec")
MODEL = "smollm2-135m-instruct"


def cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def head_wait_cpu(heavy: str, late_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        late = Path(tmp) / "late.sh"
        late.write_text(f"#!/bin/sh\nsleep {late_s}\nexec {PIPEINFER} \"$@\"\n")
        late.chmod(0o755)
        args = ["generate", MODEL, "-p", "Hi", "-n", "4", "--threads", "1"]
        env = {**os.environ, "MPIR_CVAR_ENABLE_HEAVY_YIELD": heavy}
        proc = subprocess.Popen([MPIEXEC, "-n", "1", PIPEINFER, *args, ":", "-n", "1", "-env", "PIPEINFER_CACHE",
                                 str(Path(tmp) / "empty"), str(late), *args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        head, t0 = None, time.monotonic()
        while head is None and time.monotonic() - t0 < 10:
            for entry in Path("/proc").iterdir():
                try:
                    if entry.name.isdigit() and int(entry.name) != proc.pid and \
                            b"PMI_RANK=0\0" in (entry / "environ").read_bytes() and \
                            b"pipeinfer\0generate" in (entry / "cmdline").read_bytes():
                        head = int(entry.name)
                except OSError:
                    continue
            time.sleep(0.05)
        time.sleep(1.0)  # past the head's imports
        c0, w0 = cpu_s(head), time.monotonic()
        time.sleep(late_s - 2.0)
        used, waited = cpu_s(head) - c0, time.monotonic() - w0
        _, err = proc.communicate(timeout=60)
    return {"heavy_yield": heavy, "waited_s": round(waited, 2), "head_cpu_s": round(used, 2),
            "cpu_fraction": round(used / waited, 3), "error_line": err.decode().strip().splitlines()[-1:]}


def decode_speed(heavy: str) -> float:
    r = subprocess.run([PIPEINFER, "generate", MODEL, "-p", "Write a story about a cat", "-n", "96", "--ranks", "2",
                        "--threads", "1", "--draft", "lookup", "-M", "pipeinfer"],
                       capture_output=True, text=True, env={**os.environ, "MPIR_CVAR_ENABLE_HEAVY_YIELD": heavy})
    m = re.search(r"decode ([0-9.]+) tok/s", r.stderr)
    if r.returncode != 0 or m is None:
        raise SystemExit(f"Error: the generate job failed: {r.stderr.strip()[-300:]}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--late", type=float, default=6.0, help="seconds rank 1 starts after rank 0 (default 6)")
    ap.add_argument("--repeat", type=int, default=3, help="speed pairs (default 3)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.late < 3:
        raise SystemExit("Error: --late must be at least 3 seconds")
    wait = [head_wait_cpu(h, a.late) for h in ("1", "0")]
    speed = {"1": [], "0": []}
    for _ in range(a.repeat):
        for h in ("0", "1"):
            speed[h].append(decode_speed(h))
    out = {"wait": wait, "decode_tok_per_s": speed,
           "ratio_heavy_on_vs_off": [round(x / y, 3) for x, y in zip(speed["1"], speed["0"])]}
    if a.json:
        print(json.dumps(out))
        return
    print("| heavy yield | head waited (s) | head CPU (s) | CPU fraction |")
    print("|---|---:|---:|---:|")
    for w in wait:
        print(f"| {w['heavy_yield']} | {w['waited_s']} | {w['head_cpu_s']} | {w['cpu_fraction']:.0%} |")
    print()
    print("2-rank pipeinfer (lookup) decode tok/s, interleaved pairs:")
    for x, y, r in zip(speed["0"], speed["1"], out["ratio_heavy_on_vs_off"]):
        print(f"  heavy 0: {x:6.2f}   heavy 1: {y:6.2f}   ratio {r:.3f}")


if __name__ == "__main__":
    main()
