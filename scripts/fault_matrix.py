#!/usr/bin/env python3
"""The fault matrix: every message tag x every fault (drop, delay, dup, kill, stall), injected with
PIPEINFER_DEBUG_FAULT on the rank that sends it, in a real `pipeinfer generate` job.

Each cell must end either with exactly the text of the same job without a fault (`ok`: the fault
was tolerated) or with one `Error: …` line that names a rank (`error`), within WITHIN_S seconds of
the fault firing, with no process of the job left. Anything else fails the cell: a hang, text that
differs from the reference, several lines, a traceback, a process left behind.

    .venv/bin/python scripts/fault_matrix.py                 # the whole matrix (make fault-matrix)
    .venv/bin/python scripts/fault_matrix.py --subset        # the cells `make test` runs
    .venv/bin/python scripts/fault_matrix.py --only draft-rank/result@2 --json build/faults.json

Every job runs with --rank-timeout 3 (--rank-timeout changes it), so that a lost message is noticed
within the cell's 10 s. Exit status 1 if any cell failed.
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
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from jobprocs import job_env, marked_pids  # noqa: E402

WITHIN_S = 10.0  # a cell must end this soon after its fault fired
HANG_S = 90.0  # a job still running after this long is a hang (the cell fails)
RANK_TIMEOUT_S = 3  # --rank-timeout of every job: a lost message is noticed this soon
PROMPT = "Write a short story about a lighthouse keeper."
# Seeded sampling at a temperature, and a draft that always speculates: the draft (the target
# itself, greedy) is often refused, so runs are cancelled and every tag is sent.
COMMON = ["--chat", PROMPT, "-n", "32", "--ctx", "512", "--threads", "1", "--temp", "0.8", "--seed", "3",
          "--p-accept", "0"]
MODES = ("drop", "delay=1.5", "dup", "kill", "stall")
# Where a job fails on purpose, for the tags sent only after a failure (ERROR, ABORT): rank 2 raises
# at its 3rd run (a fault of the same PIPEINFER_DEBUG_FAULT).
FAIL_FIRST = "2:raise:3"

# topology -> extra arguments, and its rows: (tag, sending rank, which of its messages)
TOPOLOGIES = {
    "draft-rank": (["--layer-split", "1,1,1/1", "--mode", "pipeinfer", "--draft", "{model}"], [
        ("stream", 0, 6), ("stream", 1, 6), ("payload", 0, 4), ("payload", 1, 4), ("result", 2, 4),
        ("result_data", 2, 3), ("draft_req", 0, 3), ("draft_rep", 3, 2), ("stats", 1, 1),
        ("stats", 3, 1), ("clock", 0, 2), ("clock", 2, 2), ("heartbeat", 0, 1), ("heartbeat", 2, 1),
        ("error", 2, 1), ("abort", 0, 1),
    ]),
    # The draft on the head: no draft-rank tags; runs are cancelled here (CANCEL is sent).
    "draft-on-head": (["--ranks", "3", "--mode", "pipeinfer", "--draft", "{model}"], [
        ("stream", 0, 6), ("result", 2, 4), ("cancel", 0, 1), ("heartbeat", 1, 1),
    ]),
}
# A representative subset (make test): every fault mode, every kind of message, both topologies.
SUBSET = [
    "draft-rank/stream@1:drop", "draft-rank/result@2:dup", "draft-rank/stream@1:delay=1.5",
    "draft-rank/draft_rep@3:drop", "draft-rank/result_data@2:kill", "draft-rank/stats@1:stall",
    "draft-on-head/cancel@0:drop", "draft-on-head/heartbeat@1:drop", "draft-on-head/result@2:stall",
    # A late draft reply: before the fix, often a rank left with an unreceived message at the end and
    # the job that had printed the right text ended "Killed (signal 9)".
    "draft-rank/draft_rep@3:delay=1.5",
]


@dataclass
class Cell:
    topology: str
    tag: str
    rank: int
    nth: int
    mode: str
    outcome: str = ""  # ok | error | not reached | FAIL
    detail: str = ""  # the error line, or why the cell failed
    seconds_after_fault: float | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.topology}/{self.tag}@{self.rank}:{self.mode}"


def command(model: str, topology: str, rank_timeout: float = RANK_TIMEOUT_S) -> list[str]:
    extra = [a.format(model=model) for a in TOPOLOGIES[topology][0]]
    return [sys.executable, "-m", "pipeinfer_cli", "generate", model, *COMMON, "--rank-timeout", f"{rank_timeout:g}",
            *extra]


def run_job(cmd: list[str], **env: str) -> tuple[subprocess.CompletedProcess | None, float, list[int]]:
    """Run one marked job; (result or None on a hang, end time, processes of it left behind)."""
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=job_env(marker, **env), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=HANG_S)
        result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        result = None
    t_end = time.time()
    deadline = time.monotonic() + 5
    while (left := marked_pids(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    return result, t_end, left


def judge(cell: Cell, result, t_end: float, left: list[int], fired: list[str], reference: str,
          within_s: float | None = WITHIN_S) -> None:
    """Sort one cell's run into ok / error / not reached / FAIL (see the module doc). within_s: None
    reports the seconds without judging them (tests never assert on wall-clock time)."""
    if left:
        cell.problems.append(f"processes left behind: {left}")
    if result is None:
        cell.problems.append(f"still running after {HANG_S:g} s (a hang)")
        cell.outcome = "FAIL"
        return
    t_fault = float(fired[0].split()[0]) if fired else None
    if t_fault is not None:
        cell.seconds_after_fault = round(t_end - t_fault, 1)
    lines = result.stderr.strip().splitlines()
    must_fail = cell.tag in ("error", "abort")
    if result.returncode == 0 and not must_fail:
        if result.stdout != reference:
            cell.problems.append("exit 0 with text that differs from the fault-free run")
        if lines and not all(line.startswith("pipeinfer: ") for line in lines):
            cell.problems.append(f"unexpected stderr: {lines[:3]}")
        cell.outcome = "ok" if fired else "not reached"
    else:
        cell.outcome = "error"
        cell.detail = lines[0] if lines else ""
        if len(lines) != 1 or not lines[0].startswith("Error: "):
            cell.problems.append(f"not one Error: line: {lines[:4]}")
        elif not re.search(r"\brank \d", lines[0]):
            cell.problems.append("the error does not name a rank")
        printed = result.stdout[:-1] if result.stdout.endswith("\n") else result.stdout  # the line ended before the error
        if not reference.startswith(printed):
            cell.problems.append("text printed before the error differs from the fault-free run")
        if result.returncode == 0:
            cell.problems.append("exit 0 although the job failed on purpose")
        if within_s is not None and cell.seconds_after_fault is not None and cell.seconds_after_fault > within_s:
            cell.problems.append(f"ended {cell.seconds_after_fault} s after the fault (> {within_s:g} s)")
    if not fired and not must_fail:
        cell.problems.append("the fault never fired (no such message): pick a smaller N")
    if cell.problems:
        cell.outcome = "FAIL"


def run_cell(model: str, cell: Cell, reference: str, rank_timeout: float = RANK_TIMEOUT_S,
             within_s: float | None = WITHIN_S) -> Cell:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "fired"
        faults = [f"{cell.rank}:{cell.tag}:{cell.nth}:{cell.mode}"]
        if cell.tag in ("error", "abort"):
            faults.append(FAIL_FIRST)
        env = {"PIPEINFER_DEBUG_FAULT": ",".join(faults), "PIPEINFER_DEBUG_FAULT_LOG": str(log)}
        result, t_end, left = run_job(command(model, cell.topology, rank_timeout), **env)
        fired = log.read_text().splitlines() if log.exists() else []
    judge(cell, result, t_end, left, fired, reference, within_s)
    return cell


def reference_text(model: str, topology: str) -> str:
    result, _, left = run_job(command(model, topology))
    if result is None or result.returncode != 0 or left:
        raise SystemExit(f"the fault-free {topology} job failed: {result and result.stderr}")
    return result.stdout


def cells(only: list[str] | None) -> list[Cell]:
    out = []
    for topology, (_, rows) in TOPOLOGIES.items():
        for tag, rank, nth in rows:
            for mode in MODES:
                cell = Cell(topology, tag, rank, nth, mode)
                if only is None or cell.name in only or f"{topology}/{tag}@{rank}" in only:
                    out.append(cell)
    return out


def table(done: list[Cell]) -> str:
    """Markdown: one row per (topology, tag, sender), one column per fault mode."""
    rows = {}
    for c in done:
        rows.setdefault((c.topology, c.tag, c.rank), {})[c.mode] = c
    lines = ["| topology | tag (sending rank) | " + " | ".join(m.split("=")[0] for m in MODES) + " |",
             "|---|---|" + "---|" * len(MODES)]
    for (topology, tag, rank), by_mode in rows.items():
        marks = []
        for m in MODES:
            c = by_mode.get(m)
            marks.append("" if c is None else c.outcome + (f" {c.seconds_after_fault:g} s" if c.outcome == "error"
                                                            and c.seconds_after_fault is not None else ""))
        lines.append(f"| {topology} | {tag.upper()} ({rank}) | " + " | ".join(marks) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: smollm2-135m-instruct from the cache)")
    ap.add_argument("--subset", action="store_true", help="only the representative cells make test runs")
    ap.add_argument("--only", action="append", help="a cell (topology/tag@rank:mode) or a row (topology/tag@rank)")
    ap.add_argument("--json", type=Path, help="write every cell here")
    ap.add_argument("--rank-timeout", type=float, default=RANK_TIMEOUT_S, help="the jobs' --rank-timeout")
    args = ap.parse_args(argv)
    model = args.model or subprocess.check_output(
        [sys.executable, "-m", "pipeinfer_cli", "models", "path", "smollm2-135m-instruct"], text=True).strip()
    todo = cells(SUBSET if args.subset else args.only)
    references = {t: reference_text(model, t) for t in sorted({c.topology for c in todo})}
    done = []
    for i, cell in enumerate(todo, 1):
        run_cell(model, cell, references[cell.topology], args.rank_timeout)
        done.append(cell)
        extra = f" ({cell.seconds_after_fault} s after the fault)" if cell.seconds_after_fault is not None else ""
        print(f"[{i}/{len(todo)}] {cell.name}: {cell.outcome}{extra} {cell.detail}"
              + "".join(f"\n    - {p}" for p in cell.problems), file=sys.stderr, flush=True)
    print(table(done))
    failed = [c for c in done if c.outcome == "FAIL"]
    counts = {o: sum(c.outcome == o for c in done) for o in ("ok", "error", "not reached", "FAIL")}
    print(f"\n{len(done)} cells: " + ", ".join(f"{n} {o}" for o, n in counts.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(c) for c in done], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
