#!/usr/bin/env python3
"""`serve --parallel` against today's FIFO server (`--parallel 1`), through `pipeinfer bench --concurrency`.

For each topology (ranks x threads) and mode, one FIFO server and one parallel server (P = the
largest level) are loaded with the same closed-loop requests at every level (AsyncOpenAI clients,
streaming); the table gives aggregate tok/s of both, their ratio, and p50/p99 TTFT and ITL.
Every text must equal its level-1 text (bench checks it and exits 1 otherwise). With --policies,
pipeinfer mode is also run with each --load-policy at the levels given.

Without --split the parallel server runs its default split (`serve --parallel N` on several ranks:
balanced by measured time for N requests at once, docs/server.md). Every server of a rank count
gets one profile (--profile RANKS=FILE, else `pipeinfer calibrate --quick` of those ranks, made
once in --workdir), and beside each measured aggregate the script prints what `pipeinfer plan
--parallel C` predicts on that profile and the parallel server's split (--no-predict: not).

    .venv/bin/python -m benchmarks.parallel qwen2.5-coder-0.5b-instruct --draft lookup \\
        --ranks 2 3 --levels 1,2,4,8 --limit 8 -n 64 --json build/parallel.json
    .venv/bin/python -m benchmarks.parallel qwen2.5-coder-0.5b-instruct --draft lookup \\
        --ranks 2 --levels 1,2 --limit 8 -n 64 --split 2=0.65,0.35 --json build/parallel_hand.json
    .venv/bin/python -m benchmarks.parallel qwen2.5-coder-0.5b-instruct --draft lookup \\
        --ranks 2 3 --levels 1,2 --modes pipeinfer --policies --limit 8 -n 64 --json build/policies.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks.report import Column, fmt, publish, render
from benchmarks.runner import log, pipeinfer, run_json, shown

POLICIES = ("yield", "round-robin", "no-spec")


def job(argv: list, out: Path | None = None) -> dict:
    """The JSON of `pipeinfer ARGV` (written to out, else printed); one line and exit 1 when it fails."""
    cmd = pipeinfer(*argv)
    log(f"+ {shown(cmd)}")
    run = run_json(cmd, out)
    if not run.ok:
        sys.exit(f"Error: {argv[0]} failed (exit {run.returncode}): {run.error}; the command was: {shown(cmd)}")
    return run.doc


def run_bench(model: str, args, ranks: int, mode: str, parallel: int, policy: str | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "load.json"
        argv = ["bench", model, "--modes", mode, "--concurrency", args.levels, "--parallel", str(parallel),
                "--limit", str(args.limit), "-n", str(args.n_predict), "--ranks", str(ranks),
                "--threads", ",".join(["1"] * ranks), "--ctx", str(args.ctx), "--json", str(out)]
        if args.draft and mode != "iterative":
            argv += ["--draft", args.draft]
        if policy is not None:
            argv += ["--load-policy", policy]
        if args.prompts:
            argv += ["--prompts", args.prompts]
        if ranks in args.layer_split:
            argv += ["--layer-split", args.layer_split[ranks]]
        if ranks in args.profiles:
            argv += ["--profile", str(args.profiles[ranks])]  # the parallel server's default split comes from it
        return job(argv, out)


def ensure_profile(model: str, args, ranks: int) -> None:
    """The profile every server and prediction of this rank count shares: --profile, else a quick
    calibration of these ranks (1 thread each, as the benchmark runs them), made once."""
    if ranks in args.profiles:
        return
    path = Path(args.workdir) / f"profile-{ranks}r.json"
    if not path.is_file():
        argv = ["calibrate", model, "--ranks", str(ranks), "--threads", ",".join(["1"] * ranks), "--quick",
                "--ctx", str(args.ctx), "--out", str(path)]
        job(argv + (["--draft", args.draft] if args.draft else []), path)
    args.profiles[ranks] = path


def predict(model: str, args, ranks: int, mode: str, levels: list[int]) -> dict[int, dict]:
    """{level: predicted tok_per_s, ttft_ms, itl_ms, layer_split} of `pipeinfer plan --parallel C` on
    the parallel server's split (--split, else its default: auto for C requests); level 1: the same
    prompts one at a time. The trace (the target's tokens for the prompts) is recorded once."""
    prompts = Path(args.prompts).stem if args.prompts else "default"
    trace = Path(args.workdir) / f"trace-{prompts}-{args.limit}x{args.n_predict}.json"  # another load: another trace
    base = ["plan", model, "--profile", str(args.profiles[ranks]), "--modes", mode, "-n", str(args.n_predict),
            "--ctx", str(args.ctx), "--threads", "1", "--json", "--layer-split", args.layer_split.get(ranks, "auto")]
    if args.draft:
        base += ["--draft", args.draft]
    out = {}
    for level in [c for c in levels if c > 1] or [2]:
        if trace.is_file():
            source = ["--trace", str(trace)]
        else:
            source = ["--limit", str(args.limit), "--record", str(trace), "--prompts", args.prompts or "default"]
        doc = job(base + source + ["--parallel", str(level)])
        p = doc["modes"][mode]
        out[level] = {k: p[k] for k in ("tok_per_s", "ttft_ms", "itl_ms")} | {"layer_split": p["settings"]["layer_split"]}
        out[1] = {k: p["one_at_a_time"][k] for k in ("tok_per_s", "ttft_ms", "itl_ms")}
    return out


def rows_of(doc: dict) -> dict[int, dict]:
    return {s["concurrency"]: s for s in doc["summary"]}


def compare(args, ranks: int, mode: str, p_max: int) -> list[dict]:
    """FIFO and parallel server at every level, with the prediction beside the parallel one."""
    fifo = rows_of(run_bench(args.model, args, ranks, mode, 1, None))
    par = rows_of(run_bench(args.model, args, ranks, mode, p_max, None))
    pred = {} if args.no_predict or ranks not in args.profiles else predict(args.model, args, ranks, mode, sorted(par))
    rows = []
    for level in sorted(fifo):
        f, p, q = fifo[level], par[level], pred.get(level)
        row = {"ranks": ranks, "mode": mode, "concurrency": level,
               "fifo": {k: f[k] for k in ("tok_per_s", "ttft_ms", "itl_ms")},
               "parallel": {k: p[k] for k in ("tok_per_s", "ttft_ms", "itl_ms")},
               "ratio": round(p["tok_per_s"] / f["tok_per_s"], 2) if f["tok_per_s"] else None,
               "predicted": q, "split": args.layer_split.get(ranks, "default")}
        rows.append(row)
        said = "" if q is None else f" (predicted {fmt(q['tok_per_s'])})"
        log(f"{ranks} ranks {mode:<10} C={level}: FIFO {fmt(f['tok_per_s'])} tok/s, parallel "
              f"{fmt(p['tok_per_s'])} tok/s{said} ({fmt(row['ratio'], '.2f')}x); TTFT p50/p99 "
              f"{fmt(f['ttft_ms']['p50'], '.0f')}/{fmt(f['ttft_ms']['p99'], '.0f')} vs "
              f"{fmt(p['ttft_ms']['p50'], '.0f')}/{fmt(p['ttft_ms']['p99'], '.0f')} ms; ITL p50/p99 "
              f"{fmt(f['itl_ms']['p50'])}/{fmt(f['itl_ms']['p99'])} vs "
              f"{fmt(p['itl_ms']['p50'])}/{fmt(p['itl_ms']['p99'])} ms")
    return rows


def policies(args, ranks: int, mode: str, p_max: int) -> list[dict]:
    runs = {pol: rows_of(run_bench(args.model, args, ranks, mode, p_max, pol)) for pol in POLICIES}
    rows = []
    for level in sorted(runs["yield"]):
        row = {"ranks": ranks, "mode": mode, "concurrency": level}
        for pol in POLICIES:
            r = runs[pol][level]
            row[pol] = {"tok_per_s": r["tok_per_s"], "ttft_ms": r["ttft_ms"], "itl_ms": r["itl_ms"]}
        rows.append(row)
        log(f"{ranks} ranks {mode:<10} C={level}: " + ", ".join(
            f"{pol} {fmt(row[pol]['tok_per_s'])} tok/s" for pol in POLICIES))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("model")
    ap.add_argument("--draft", default="lookup")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--modes", default="iterative,pipeinfer")
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--prompts", help="bench's --prompts (default: its default set)")
    ap.add_argument("--split", action="append", default=[], metavar="RANKS=SPLIT",
                    help="--layer-split for a rank count, e.g. 2=0.65,0.35 (default: the server's own: for the "
                         "parallel server, balanced by measured time for the load)")
    ap.add_argument("--profile", action="append", default=[], metavar="RANKS=FILE",
                    help="the profile (`pipeinfer calibrate`) of a rank count, given to every server and to the "
                         "prediction (default: a quick calibration of those ranks, made once in --workdir)")
    ap.add_argument("--workdir", default="build/bench_parallel", help="where the calibrated profiles and the "
                    "prediction's trace are kept (default: %(default)s)")
    ap.add_argument("--no-predict", action="store_true", help="do not print `plan --parallel`'s prediction")
    ap.add_argument("--policies", action="store_true", help="compare the load policies (parallel server only)")
    ap.add_argument("--json")
    ap.add_argument("--markdown", help="write the table here too")
    args = ap.parse_args()
    args.layer_split = {int(k): v for k, v in (x.split("=", 1) for x in args.split)}
    args.profiles = {int(k): Path(v) for k, v in (x.split("=", 1) for x in args.profile)}
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    p_max = max(int(x) for x in args.levels.split(","))
    results = []
    for ranks in args.ranks:
        if ranks > 1 and (ranks not in args.layer_split or not args.no_predict):
            ensure_profile(args.model, args, ranks)
        for mode in args.modes.split(","):
            results += (policies if args.policies else compare)(args, ranks, mode, p_max)
    publish(render(table_columns(args.policies), results),
            {"model": args.model, "draft": args.draft, "levels": args.levels, "limit": args.limit,
             "n_predict": args.n_predict, "profiles": {r: str(p) for r, p in args.profiles.items()}, "rows": results},
            args.json, args.markdown)


def table_columns(policies: bool) -> list[Column]:
    """Per (ranks, mode, level): the servers' aggregate tok/s (and TTFT/ITL p50/p99), or each policy's."""
    head = [Column("ranks", lambda r: str(r["ranks"]), "l"), Column("mode", lambda r: f"`{r['mode']}`", "l"),
            Column("clients", lambda r: str(r["concurrency"]))]
    if policies:
        return head + [Column(f"{pol} tok/s", lambda r, p=pol: fmt(r[p]["tok_per_s"], ".1f")) for pol in POLICIES]
    pct = (lambda side, k: lambda r: f"{fmt(r[side][k]['p50'], '.0f')}/{fmt(r[side][k]['p99'], '.0f')}")  # noqa: E731
    return head + [Column("FIFO tok/s", lambda r: fmt(r["fifo"]["tok_per_s"], ".1f")),
                   Column("parallel tok/s", lambda r: fmt(r["parallel"]["tok_per_s"], ".1f")),
                   Column("predicted", lambda r: fmt((r["predicted"] or {}).get("tok_per_s"), ".1f")),
                   Column("×", lambda r: fmt(r["ratio"], ".2f")),
                   Column("TTFT p50/p99 ms (FIFO, parallel)", lambda r: f"{pct('fifo', 'ttft_ms')(r)}, {pct('parallel', 'ttft_ms')(r)}"),
                   Column("ITL p50/p99 ms (FIFO, parallel)", lambda r: f"{pct('fifo', 'itl_ms')(r)}, {pct('parallel', 'itl_ms')(r)}")]


if __name__ == "__main__":
    main()
