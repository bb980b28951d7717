"""Predicted against measured: for each configuration, `pipeinfer calibrate` (a profile of these
very ranks), `pipeinfer plan` (predictions from it, with the trace recorded on the same prompts),
then `pipeinfer bench` on the same prompts; a table of predicted and measured tok/s and TTFT per
mode, the error of each, and the whole as JSON.

    python scripts/validate_plan.py                       # every configuration (about 25 minutes)
    python scripts/validate_plan.py --only 2r,lookup-2r   # some of them
    python scripts/validate_plan.py --json out.json

Configurations on emulated hosts (`emu-…`) need root (scripts/emulate-cluster.sh). Run nothing
else meanwhile: the machine is shared and the figures are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPEINFER = [sys.executable, "-m", "pipeinfer_cli"]
EMU = [str(ROOT / "scripts" / "emulate-cluster.sh")]

# name: (model, draft, ranks, layer split, emulated hosts and link rate or None)
CONFIGS = {
    "1r": ("qwen-coder", None, 1, None, None),
    "2r": ("qwen-coder", None, 2, None, None),
    "3r": ("qwen-coder", None, 3, None, None),
    "1/1": ("qwen-coder", None, 2, "1/1", None),
    "lookup-2r": ("qwen2.5-coder-1.5b-instruct", "lookup", 2, None, None),
    "emu-2h-100mbit": ("qwen-coder", None, 2, None, (2, "100mbit")),
    "emu-2h-10mbit": ("qwen-coder", None, 2, None, (2, "10mbit")),
    "emu-3h-100mbit": ("qwen-coder", None, 3, None, (3, "100mbit")),
}


class StepFailed(RuntimeError):
    pass


def run(cmd: list[str], emu=None) -> subprocess.CompletedProcess:
    full = EMU + ["exec", "--"] + cmd if emu else cmd
    print("+", " ".join(full), file=sys.stderr, flush=True)
    r = subprocess.run(full, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise StepFailed(f"failed ({r.returncode}): {' '.join(full)}\n{r.stderr[-2000:]}")
    return r


def job_args(draft, ranks, split) -> list[str]:
    out = ["--ranks", str(ranks)]
    if draft:
        out += ["--draft", draft]
    if split:
        out += ["--layer-split", split]
    return out


def validate(name: str, work: Path, prompts: str, limit: int, n: int, repeat: int) -> dict:
    model, draft, ranks, split, emu = CONFIGS[name]
    if emu:
        run(EMU + ["up", str(emu[0]), "--rate", emu[1]])
    try:
        stem = name.replace("/", "-")
        prof, trace, bench = work / f"{stem}.profile.json", work / f"{stem}.trace.json", work / f"{stem}.bench.json"
        job = job_args(draft, ranks, split)
        run(PIPEINFER + ["calibrate", model, *job, "--out", str(prof)], emu)
        # bench runs every mode with calibrate's default threads (not generate's whole-host iterative):
        # plan that job
        threads = ",".join(str(r["threads"]) for r in json.loads(prof.read_text())["ranks"])
        plan_out = run(PIPEINFER + ["plan", model, "--profile", str(prof), "--prompts", prompts, "--limit",
                                    str(limit), "-n", str(n), "--record", str(trace), "--json", "--threads", threads]
                       + (["--draft", draft] if draft else []) + (["--layer-split", split] if split else [])).stdout
        (work / f"{stem}.plan.json").write_text(plan_out)
        plan = json.loads(plan_out)
        run(PIPEINFER + ["bench", model, *job, "--prompts", prompts, "--limit", str(limit), "-n", str(n),
                         "--repeat", str(repeat), "--json", str(bench)], emu)
    finally:
        if emu:
            run(EMU + ["down"])
    measured = json.loads(bench.read_text())["summary"]
    rows = {}
    for mode, p in plan["modes"].items():
        m = measured.get(mode, {})
        rows[mode] = {"predicted_tok_per_s": p["tok_per_s"], "measured_tok_per_s": m.get("tok_per_s", {}).get("median"),
                      "predicted_ttft_s": p["ttft_s"], "measured_ttft_s": m.get("ttft_s")}
        for k in ("tok_per_s", "ttft_s"):
            pv, mv = rows[mode][f"predicted_{k}"], rows[mode][f"measured_{k}"]
            rows[mode][f"error_{k}"] = (pv - mv) / mv if pv and mv else None
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated configuration names: " + ", ".join(CONFIGS))
    ap.add_argument("--prompts", default="default")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", type=Path, help="keep every profile, trace, plan and bench file in this directory")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        sys.exit(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    results = {}
    print(f"{'config':16} {'mode':12} {'pred tok/s':>10} {'meas tok/s':>10} {'err':>7} {'pred TTFT':>9} "
          f"{'meas TTFT':>9} {'err':>7}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in names:
            try:
                results[name] = validate(name, work, args.prompts, args.limit, args.n, args.repeat)
            except StepFailed as e:
                print(f"{name}: {e}", file=sys.stderr, flush=True)
                results[name] = {"failed": str(e)}
                continue
            for mode, r in results[name].items():
                _print_row(name, mode, r)
            if args.json:  # after every configuration: a long run that stops keeps what it measured
                args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                 "results": results}, indent=1))


def _print_row(name: str, mode: str, r: dict) -> None:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    print(f"{name:16} {mode:12} {f(r['predicted_tok_per_s'], '10.2f')} {f(r['measured_tok_per_s'], '10.2f')} "
          f"{f(r['error_tok_per_s'], '+7.1%')} {f(r['predicted_ttft_s'], '9.3f')} {f(r['measured_ttft_s'], '9.3f')} "
          f"{f(r['error_ttft_s'], '+7.1%')}", flush=True)


if __name__ == "__main__":
    main()
