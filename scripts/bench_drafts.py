#!/usr/bin/env python3
"""Drafts side by side: cross-vocabulary, same-family and hybrid drafts against `iterative`.

For each topology (1 rank, 2 stages, 3 stages, a stage plus a draft rank `1/1`), prompt set
(`default`, `grounded`) and draft (SmolLM2-135M and Gemma 3 270M, translated; the Qwen2.5-Coder
0.5B, direct; and `lookup+` each), one `pipeinfer bench` command as a user runs it, on the
Qwen2.5-Coder-1.5B target, with `--modes iterative,pipeinfer` (each job has its own iterative
baseline, interleaved with pipeinfer by bench itself). Every configuration runs once per round,
every other round in reverse order, so that background load hits them alike; the records of all
rounds are pooled.

Prints one row per (configuration, mode): tok/s and decode tok/s (medians), acceptance (and per
source for hybrid drafts), the speedup over the same job's iterative (bench's paired figure), and
scripts/core_budget.py's CPU ms per committed token with the bound it implies (cores × 1000 / CPU
ms). Writes every figure and the raw bench documents to --json. Exit status 1 if any bench found
tokens that differ between modes, 2 if a bench command failed. Not a test: nothing else asserts.

    python scripts/bench_drafts.py --json build/bench_drafts.json                  # the full run
    python scripts/bench_drafts.py --limit 1 -n 16 --rounds 1 --warmup 0 \\
        --topologies 2 --drafts smollm2 --prompt-sets default --json /tmp/smoke.json  # a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import core_budget  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFTS = {  # short name -> --draft value
    "smollm2": "smollm2-135m-instruct",
    "gemma3": "gemma3-270m",
    "qwen0.5b": "qwen2.5-coder-0.5b-instruct",
    "lookup+smollm2": "lookup+smollm2-135m-instruct",
    "lookup+gemma3": "lookup+gemma3-270m",
    "lookup+qwen0.5b": "lookup+qwen2.5-coder-0.5b-instruct",
}
TOPOLOGIES = {"1": ["--ranks", "1"], "2": ["--ranks", "2"], "3": ["--ranks", "3"], "1/1": ["--layer-split", "1/1"]}
PROMPT_SETS = ("default", "grounded")


@dataclass
class Config:
    topology: str
    prompts: str
    draft: str

    @property
    def label(self) -> str:
        return f"{self.topology} | {self.prompts} | {self.draft}"


def log(msg: str) -> None:
    print(f"[bench_drafts {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def command(a, c: Config, out: Path) -> list[str]:
    return [a.pipeinfer, "bench", TARGET, "--draft", DRAFTS[c.draft], *TOPOLOGIES[c.topology], "--modes", a.modes,
            "--prompts", c.prompts, "--limit", str(a.limit), "-n", str(a.n_predict), "--warmup", str(a.warmup),
            "--repeat", "1", "--json", str(out)]


def run_config(a, c: Config, rnd: int) -> dict:
    out = a.work_dir / f"{c.topology.replace('/', '_')}-{c.prompts}-{c.draft}-r{rnd}.json"
    cmd = command(a, c, out)
    log(f"round {rnd}: {c.label}: {' '.join(cmd)}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    run = {"label": c.label, "round": rnd, "command": cmd, "returncode": proc.returncode,
           "wall_s": time.perf_counter() - t0, "doc": None}
    if proc.returncode not in (0, 1):  # 1: the modes' tokens differ (the document still says where)
        run["stderr"] = proc.stderr[-2000:]
        log(f"  failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:] or ''}")
        return run
    run["doc"] = json.loads(out.read_text())
    return run


def pooled_acceptance(records: list[dict]) -> dict:
    drafted = sum(r["acceptance"]["drafted"] for r in records)
    accepted = sum(r["acceptance"]["accepted"] for r in records)
    out = {"drafted": drafted, "accepted": accepted, "rate": accepted / drafted if drafted else None}
    by: dict[str, list[int]] = {}
    for r in records:
        for src, row in r["acceptance"].get("by_source", {}).items():
            by.setdefault(src, [0, 0])
            by[src][0] += row["drafted"]
            by[src][1] += row["accepted"]
    if by:
        out["by_source"] = {s: {"drafted": d, "accepted": acc, "rate": acc / d if d else None} for s, (d, acc) in by.items()}
    return out


def paired_speedup(records: list[dict], mode: str, base: str = "iterative") -> float | None:
    """Geometric mean over (round, prompt) of mode's tok/s over the same job's iterative."""
    by: dict[tuple, dict[str, float]] = {}
    for r in records:
        if r.get("tok_per_s"):
            by.setdefault((r["_round"], r["prompt_id"]), {})[r["mode"]] = r["tok_per_s"]
    ratios = [v[mode] / v[base] for v in by.values() if mode in v and base in v]
    return statistics.geometric_mean(ratios) if ratios else None


def summarize(configs: list[Config], runs: list[dict], cores: int) -> list[dict]:
    rows = []
    for c in configs:
        recs = [{**r, "_round": run["round"]} for run in runs if run["label"] == c.label and run["doc"]
                for r in run["doc"]["records"] if not r.get("warmup")]
        vocab = next((r.get("draft_vocab") for r in recs if r.get("draft_vocab")), None)
        for mode in sorted({r["mode"] for r in recs}, key=lambda m: m != "iterative"):
            rs = [r for r in recs if r["mode"] == mode]
            budget = core_budget.summarize([(c.label, r) for r in rs], cores)[0]
            med = lambda k: statistics.median([r[k] for r in rs if r.get(k)]) if any(r.get(k) for r in rs) else None  # noqa: E731
            rows.append({"topology": c.topology, "prompts": c.prompts, "draft": c.draft, "draft_vocab": vocab,
                         "mode": mode, "n": len(rs), "tok_per_s": med("tok_per_s"),
                         "decode_tok_per_s": med("decode_tok_per_s"), "acceptance": pooled_acceptance(rs),
                         "speedup_vs_iterative": paired_speedup(recs, mode) if mode != "iterative" else 1.0,
                         "cpu_ms_per_token": budget["cpu_ms_per_token"], "bound_tok_per_s": budget["bound_tok_per_s"],
                         "tokens_identical": all(run["doc"].get("tokens_identical", True) for run in runs
                                                 if run["label"] == c.label and run["doc"])})
    return rows


def fmt(x, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def acceptance_cell(acc: dict) -> str:
    if not acc["drafted"]:
        return "–"
    cell = f"{acc['rate']:.0%}"
    by = acc.get("by_source")
    if by:
        cell += " (" + ", ".join(f"{s} {v['accepted']}/{v['drafted']}" for s, v in sorted(by.items())) + ")"
    return cell


def table(rows: list[dict]) -> str:
    lines = ["| topology | prompts | draft | vocab | mode | tok/s | decode tok/s | acceptance | × iterative "
             "| CPU ms/token | bound tok/s |", "|---|---|---|---|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['topology']} | {r['prompts']} | {r['draft']} | {r['draft_vocab'] or '–'} | {r['mode']} "
                     f"| {fmt(r['tok_per_s'])} | {fmt(r['decode_tok_per_s'])} | {acceptance_cell(r['acceptance'])} "
                     f"| {fmt(r['speedup_vs_iterative'])} | {fmt(r['cpu_ms_per_token'], '.0f')} "
                     f"| {fmt(r['bound_tok_per_s'], '.1f')} |" + ("" if r["tokens_identical"] else " TOKENS DIFFER"))
    return "\n".join(lines)


def pick(text: str, known, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in known]
    if bad or not items:
        raise SystemExit(f"Error: unknown {what} {', '.join(bad) or '(none)'}; choose from {', '.join(known)}")
    return items


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--limit", type=int, default=3, help="prompts of each set (default 3)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--modes", default="iterative,pipeinfer", help="bench's --modes (default iterative,pipeinfer)")
    ap.add_argument("--topologies", default=",".join(TOPOLOGIES), help=f"comma-separated, of {', '.join(TOPOLOGIES)}")
    ap.add_argument("--drafts", default=",".join(DRAFTS), help=f"comma-separated, of {', '.join(DRAFTS)}")
    ap.add_argument("--prompt-sets", default=",".join(PROMPT_SETS), help="comma-separated, of default, grounded")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--pipeinfer", default=str(Path(sys.executable).with_name("pipeinfer")))
    ap.add_argument("--work-dir", type=Path, default=ROOT / "build" / "bench_drafts")
    ap.add_argument("--json", type=Path, required=True)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    configs = [Config(t, p, d) for p in pick(a.prompt_sets, PROMPT_SETS, "prompt set")
               for t in pick(a.topologies, TOPOLOGIES, "topology") for d in pick(a.drafts, DRAFTS, "draft")]
    a.work_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for rnd in range(a.rounds):
        for c in configs if rnd % 2 == 0 else configs[::-1]:
            runs.append(run_config(a, c, rnd))
    rows = summarize(configs, runs, a.cores)
    print(table(rows))
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"target": TARGET, "cores": a.cores, "args": {k: str(v) for k, v in vars(a).items()},
                                  "rows": rows, "runs": runs}, indent=1))
    log(f"wrote {a.json}")
    if any(r["returncode"] not in (0, 1) for r in runs):
        return 2
    return 0 if all(r["tokens_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
