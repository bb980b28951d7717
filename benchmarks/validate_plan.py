"""Predicted against measured: for each configuration, `pipeinfer calibrate` (a profile of these
very ranks, with the job's threads), `pipeinfer plan` (predictions from it for the job with the
same threads, the trace recorded on the same prompts), then `pipeinfer bench` of that job (the same
ranks, threads and prompts); a table of predicted and measured tok/s and TTFT per mode, the error
of each, and the whole as JSON.

    python -m benchmarks.validate_plan                          # every configuration (about 30 minutes)
    python -m benchmarks.validate_plan --only 2r,3r --quick     # some of them, quick calibrations
    python -m benchmarks.validate_plan --dry-run                # the commands, without running them
    python -m benchmarks.validate_plan --json out.json --keep build/validate

Every rank computes with the configuration's threads in all three commands (`--threads`), so the
profile measures the job that `plan` predicts and `bench` runs. A configuration whose step fails
(or whose plan is refused) is reported on its row and the others go on. Configurations on emulated
hosts (`emu-…`) need root (an emulated cluster, benchmarks/emulated.py). Run nothing else meanwhile: the machine is
shared and the figures are wall-clock.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.emulated import Failure, emulated_cluster
from benchmarks.report import publish, write_json
from benchmarks.runner import JobRun, log, pipeinfer, run_json, shown
from cluster.cgroups import CgroupError

PREFIX, SUBNET = "pi-vp", "10.216.0.0/24"  # the emulated cluster of the `emu-…` configurations
MODES = ("iterative", "speculative", "pipeinfer")
GOAL = 0.10  # the error each row should stay within


@dataclass(frozen=True)
class Config:
    label: str
    model: str
    ranks: int
    threads: str  # per rank, as --threads takes it
    draft: str | None = None
    split: str | None = None
    emu: tuple[int, str] | None = None  # emulated hosts and their link rate
    modes: tuple[str, ...] = MODES


CONFIGS = {
    "1r": Config("1 rank (2 threads)", "qwen-coder", 1, "2"),
    "2r": Config("2 ranks (1 thread each)", "qwen-coder", 2, "1"),
    "2r-2t": Config("2 ranks (2 threads each, one at a time)", "qwen-coder", 2, "2", modes=("iterative",)),
    "3r": Config("3 ranks (3 x 1 thread on 2 cores)", "qwen-coder", 3, "1"),
    "1/1": Config("`1/1` (draft rank)", "qwen-coder", 2, "1", split="1/1"),
    "lookup-2r": Config("2 ranks, --draft lookup", "qwen2.5-coder-1.5b-instruct", 2, "1", draft="lookup"),
    "emu-2h-100mbit": Config("2 emulated hosts, 100 Mbit/s", "qwen-coder", 2, "2", emu=(2, "100mbit")),
    "emu-2h-10mbit": Config("2 emulated hosts, 10 Mbit/s", "qwen-coder", 2, "2", emu=(2, "10mbit")),
    "emu-3h-100mbit": Config("3 emulated hosts, 100 Mbit/s", "qwen-coder", 3, "2", emu=(3, "100mbit")),
}


class StepFailed(RuntimeError):
    pass


def run(cmd: list[str], out: Path | None, env: dict | None, dry: bool = False) -> JobRun | None:
    """One step through the runner (its JSON from the file `out`, else its stdout)."""
    log("+ " + shown(cmd))
    if dry:
        return None
    job = run_json(cmd, out, env, quiet=True)
    if not job.ok:
        raise StepFailed(f"{cmd[1]} failed ({job.returncode}): {job.error}")
    return job


def commands(c: Config, files: dict[str, Path], prompts: str, limit: int, n: int, repeat: int,
             quick: bool) -> dict[str, list[str]]:
    """The three commands of one configuration: calibrate, plan, bench, with the job's ranks and threads."""
    job = ["--ranks", str(c.ranks), "--threads", c.threads] + (["--layer-split", c.split] if c.split else [])
    draft = ["--draft", c.draft] if c.draft else []
    same = ["--prompts", prompts, "--limit", str(limit), "-n", str(n), "--modes", ",".join(c.modes)]
    return {
        "calibrate": pipeinfer("calibrate", c.model, *job, *draft, "--out", files["profile"], *(["--quick"] if quick else [])),
        "plan": pipeinfer("plan", c.model, "--profile", files["profile"], *job, *draft, *same, "--record", files["trace"],
                          "--json"),
        "bench": pipeinfer("bench", c.model, *job, *draft, *same, "--repeat", repeat, "--json", files["bench"]),
    }


def validate(name: str, work: Path, args) -> dict:
    """Every step of one configuration; a failed step is recorded and the rest still run where
    they can (a refused plan still benches, so the row shows what was measured)."""
    c = CONFIGS[name]
    stem = name.replace("/", "-")
    files = {k: work / f"{stem}.{k}.json" for k in ("profile", "trace", "plan", "bench")}
    cmds = commands(c, files, args.prompts, args.limit, args.n, args.repeat, args.quick)
    out: dict = {"label": c.label, "threads": c.threads, "commands": {k: " ".join(v) for k, v in cmds.items()},
                 "failed": {}, "modes": {}}
    plan = measured = None
    hosts = emulated_cluster(PREFIX, SUBNET, *c.emu) if c.emu and not args.dry_run else contextlib.nullcontext()
    with hosts as cluster:
        env = cluster.env() if cluster is not None else None
        for step, written in (("calibrate", files["profile"]), ("plan", None), ("bench", files["bench"])):
            if step == "plan" and "calibrate" in out["failed"]:
                out["failed"]["plan"] = "no profile"
                continue
            try:
                r = run(cmds[step], written, env if step != "plan" else None, args.dry_run)
            except StepFailed as e:
                out["failed"][step] = str(e)
                log(f"{name}: {e}")
                continue
            if r is not None and step == "plan":
                files["plan"].write_text(r.output)
                plan = r.doc["modes"]
            elif r is not None and step == "bench":
                measured = r.doc["summary"]
    for mode in c.modes:
        out["modes"][mode] = _row((plan or {}).get(mode, {}), (measured or {}).get(mode, {}))
    return out


def _row(p: dict, m: dict) -> dict:
    row = {"predicted_tok_per_s": p.get("tok_per_s"), "measured_tok_per_s": (m.get("tok_per_s") or {}).get("median"),
           "predicted_ttft_s": p.get("ttft_s"), "measured_ttft_s": m.get("ttft_s")}
    for k in ("tok_per_s", "ttft_s"):
        pv, mv = row[f"predicted_{k}"], row[f"measured_{k}"]
        row[f"error_{k}"] = (pv - mv) / mv if pv and mv else None
    return row


def table(results: dict) -> list[str]:
    """The markdown table of BENCHMARKS.md, a failed step named on its configuration's rows."""
    lines = ["| configuration | mode | predicted tok/s | measured tok/s | error | predicted TTFT s | "
             "measured TTFT s | error |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for res in results.values():
        failed = "; ".join(f"{k}: {v}" for k, v in res["failed"].items())
        for i, (mode, r) in enumerate(res["modes"].items()):
            label = res["label"] if i == 0 else ""
            mark = f" ({failed})" if failed and i == 0 else ""
            lines.append(f"| {label}{mark} | {mode} | {_f(r['predicted_tok_per_s'], '.2f')} | "
                         f"{_f(r['measured_tok_per_s'], '.2f')} | {_f(r['error_tok_per_s'], '+.1%')} | "
                         f"{_f(r['predicted_ttft_s'], '.3f')} | {_f(r['measured_ttft_s'], '.3f')} | "
                         f"{_f(r['error_ttft_s'], '+.1%')} |")
    return lines


def within_goal(results: dict) -> str:
    rows = [r for res in results.values() for r in res["modes"].values()]
    parts = []
    for k, what in (("tok_per_s", "tok/s"), ("ttft_s", "TTFT")):
        errs = [r[f"error_{k}"] for r in rows if r[f"error_{k}"] is not None]
        parts.append(f"{sum(abs(e) <= GOAL for e in errs)} of {len(errs)} {what} rows")
    return f"within {GOAL:.0%}: " + ", ".join(parts) + f" ({len(rows)} rows in all)"


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="configurations:\n" + "\n".join(f"  {k:16} {c.label}: --ranks {c.ranks} "
                                                                         f"--threads {c.threads}"
                                                                         for k, c in CONFIGS.items()))
    ap.add_argument("--only", help="comma-separated configuration names (below); default: all")
    ap.add_argument("--prompts", default="default", help="the prompt set (default: default)")
    ap.add_argument("--limit", type=int, default=3, help="prompts of the set (default: 3)")
    ap.add_argument("-n", type=int, default=64, help="tokens per prompt (default: 64)")
    ap.add_argument("--repeat", type=int, default=1, help="bench's measured runs per prompt and mode (default: 1)")
    ap.add_argument("--quick", action="store_true", help="calibrate --quick (fewer repetitions)")
    ap.add_argument("--json", type=Path, help="also write the results here (after every configuration)")
    ap.add_argument("--keep", type=Path, help="keep every profile, trace, plan and bench file in this directory")
    ap.add_argument("--dry-run", action="store_true", help="print the commands of each configuration, run nothing")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        sys.exit(f"Error: unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in names:
            try:
                results[name] = validate(name, work, args)
            except (StepFailed, Failure, CgroupError, OSError, ValueError, KeyError) as e:  # the hosts, a bad file
                log(f"{name}: {e}")
                c = CONFIGS[name]
                results[name] = {"label": c.label, "threads": c.threads, "failed": {"setup": str(e)},
                                 "modes": {m: _row({}, {}) for m in c.modes}}
            doc = {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}
            if args.json:  # after every configuration: a long run that stops keeps what it measured
                write_json(args.json, doc)
    publish("\n".join(table(results)), doc, args.json, notes=[within_goal(results)])


if __name__ == "__main__":
    main()
