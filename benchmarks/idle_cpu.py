"""What an idle `pipeinfer serve` costs: each rank's CPU, and its wake-ups, while no request runs.

A server waits far longer than it computes. Every rank that waits for a message probes MPI and
sleeps between probes (src/pipeinfer_cli/transport/waits.py), and every wake-up is paid in CPU:
on a host held below one core by a quota, out of the compute the host has. This starts one
server (SmolLM2 by default, --ranks N, an even split), waits until it is ready and a little more,
then reads each rank's CPU time and context switches from /proc over --seconds, --repeat times
(one server per repeat), and reports the median per rank with its min–max.

    python -m benchmarks.idle_cpu --ranks 3 --seconds 20 --repeat 3 --json build/idle_cpu.json

Not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from pathlib import Path

from benchmarks.report import Column, fmt, fmt_spread, publish, render
from benchmarks.runner import log, pipeinfer
from benchmarks.served import Server, free_port

SETTLE_S = 3.0  # after /health says ready: the start-up's last messages and frees are over
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def rank_pids(marker: str) -> dict[int, int]:
    """{MPI rank: pid} of the processes whose environment holds the marker."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(kv.split("=", 1) for kv in (entry / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
        except OSError:
            continue
        if env.get("PIPEINFER_IDLE_MARKER") == marker and "PMI_RANK" in env:
            out[int(env["PMI_RANK"])] = int(entry.name)
    return out


def process_cpu(pid: int) -> tuple[float, int]:
    """(CPU seconds of every thread, context switches of every thread) of a process, so far."""
    cpu, switches = 0.0, 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime
            status = (task / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                switches += int(line.split()[1])
    return cpu, switches


def one_server(args, work: Path, i: int) -> dict[int, dict]:
    port, marker = free_port(), uuid.uuid4().hex
    cmd = pipeinfer("serve", args.model, "--ranks", str(args.ranks), "--port", str(port), "--threads", "1",
                    program=args.pipeinfer)
    server = Server(cmd, {**os.environ, "PIPEINFER_IDLE_MARKER": marker}, port, work / f"serve-{i}.err")
    try:
        try:
            server.wait_health(ok=("ok",), within_s=args.start_timeout)
        except RuntimeError as e:
            raise SystemExit(f"Error: the server did not start: {e}") from None
        time.sleep(SETTLE_S)
        pids = rank_pids(marker)
        if len(pids) != args.ranks:
            raise SystemExit(f"Error: found {len(pids)} of the server's {args.ranks} ranks")
        before = {r: process_cpu(p) for r, p in pids.items()}
        time.sleep(args.seconds)
        after = {r: process_cpu(p) for r, p in pids.items()}
    finally:
        server.stop()
    return {r: {"cpu_share": (after[r][0] - before[r][0]) / args.seconds,
                "wakeups_per_s": (after[r][1] - before[r][1]) / args.seconds} for r in pids}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.idle_cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0, help="how long each idle server is measured")
    ap.add_argument("--repeat", type=int, default=3, help="servers started, one measurement each")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--pipeinfer", default=None)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--work-dir", type=Path, default=Path("build/idle_cpu"))
    args = ap.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for i in range(args.repeat):
        log(f"server {i + 1}/{args.repeat}: {args.ranks} ranks, idle for {args.seconds:g} s")
        runs.append(one_server(args, args.work_dir, i))
    rows = []
    for r in sorted(runs[0]):
        rows.append({"rank": r, "cpu_share": spread([run[r]["cpu_share"] for run in runs]),
                     "wakeups_per_s": spread([run[r]["wakeups_per_s"] for run in runs])})
    cols = [Column("rank", lambda row: str(row["rank"]), "l"),
            Column("CPU while idle (% of a core)", lambda row: fmt_spread(
                {k: (v * 100 if k != "n" else v) for k, v in row["cpu_share"].items()}, ".2f")),
            Column("context switches / s", lambda row: fmt_spread(row["wakeups_per_s"], ".0f")),
            Column("µs of CPU per switch", lambda row: fmt(
                1e6 * row["cpu_share"]["median"] / row["wakeups_per_s"]["median"] if row["wakeups_per_s"]["median"] else None,
                ".0f"))]
    publish(render(cols, rows), {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                 "rows": rows, "runs": runs}, args.json, args.markdown)


if __name__ == "__main__":
    main()
