#!/usr/bin/env python3
"""Side-by-side speed of several job shapes on one machine: topologies, rank counts, threads.

Each suite is a list of configurations, each one `pipeinfer bench` command (or llama.cpp's own
decoding through benchmarks/llamacpp.py). The suite runs every configuration once per round,
every other round in reverse order, so that background load hits them alike; records of all
rounds are pooled. Figures are paired by prompt: a ratio is the geometric mean over prompts of the
per-prompt median tok/s ratio.

Suites:
- overhead    the cost of the pipeline itself: `iterative` on 1 rank against 2 ranks, the same
              threads per rank (the same compute, plus two hops per token), with and without
              the predictive wait (PIPEINFER_WAIT_PREDICT=0) or with spinning waits
              (PIPEINFER_WAIT_SPIN=1, a diagnostic), and the 1-rank job next to a process that
              wakes every 0.1 ms or one that never sleeps (what a neighbour costs by itself);
- topologies  `iterative` and `pipeinfer` on each way to place a target and its draft on the
              machine's cores (1 rank with the draft or lookup on it, 2 stages with the draft on
              the head, a stage plus a draft rank, 2 stages with lookup, 3 stages), with
              llama.cpp at all the cores as a reference;
- threads     one rank on all the cores against llama.cpp; ranks that share the cores given
              their share of threads or all of them, with OpenMP waiting passively or spinning
              briefly (GOMP_SPINCOUNT), in each mode;
- pages       `iterative` with the engine's weights and KV cache on transparent huge pages (the
              default) against 4 KiB pages (PIPEINFER_HUGEPAGES=0): 1 rank and 2 ranks at half
              the cores per rank, and 1 rank at all of them;
- drafts      `iterative` and `pipeinfer` on the Qwen2.5-Coder-1.5B target with each draft
              (SmolLM2-135M and Gemma 3 270M, translated; the pair's 0.5B; lookup+SmolLM2) on each
              topology (1 rank, 2 stages, 3 stages, a stage plus a draft rank); --prompts grounded
              for the other prompt set.

Prints a table on stdout, progress on stderr, and writes every figure and the raw bench documents
to --json. Not a test: nothing asserts.

    python -m benchmarks.topologies --suite overhead --rounds 3 --json build/bench_overhead.json

Reports on the JSON of earlier runs (several files pooled), without measuring:
- --report cores      CPU ms per committed token per configuration and mode, summed over the ranks
                      and split head + stages + draft rank (each rank's CPU time during the request),
                      the cores kept busy, and the bound cores × 1000 / CPU ms: the tok/s the same
                      work would reach with every core busy. Also reads plain `pipeinfer bench --json`.
- --report overhead   each request's wall time split into the layers' compute (the engine's time,
                      summed over the ranks) and the rest (hand-offs, waits, MPI, sampling, Python),
                      and, paired by file, round and prompt with --reference (default: the first
                      configuration), the speed ratio and the compute ratio: when the compute ratio
                      explains the speed ratio, the gap is in how fast the layers computed.

    python -m benchmarks.topologies --report cores build/bench_topologies_default.json --cores 2
    python -m benchmarks.topologies --report overhead build/overhead.json --reference "2 ranks × 1 thread(s)"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.figures import measured, median, paired_ratio, per_prompt
from benchmarks.report import fmt, markdown_table, publish
from benchmarks.runner import PIPEINFER, ROOT, log, module, pipeinfer, run_json, shown

TARGET = "qwen2.5-coder-1.5b-instruct"
PAIR = "qwen-coder"


@dataclass
class Config:
    """One job shape: a label, the `pipeinfer bench` arguments after the model, and extra env."""

    label: str
    model: str  # registry name, pair name or path
    args: list[str]  # bench options (modes, ranks, threads, draft, split)
    env: dict[str, str] = field(default_factory=dict)
    llamacpp: bool = False  # llama.cpp's own decoding (args: its --threads)
    cpus: str = ""  # run the job under `taskset -c cpus` (every rank inherits the affinity)
    neighbour: str = ""  # a process beside the run: "sleeper" (wakes every 0.1 ms) or "spinner" (never sleeps)


def suite_configs(suite: str, cores: int) -> list[Config]:
    half = max(cores // 2, 1)
    if suite == "overhead":
        one = ["--modes", "iterative", "--ranks", "1", "--threads", str(half)]
        two = ["--modes", "iterative", "--ranks", "2", "--threads", str(half)]
        return [Config(f"1 rank × {half} thread(s)", TARGET, one),
                Config(f"2 ranks × {half} thread(s)", TARGET, two),
                Config(f"2 ranks × {half}, no predictive wait", TARGET, two, {"PIPEINFER_WAIT_PREDICT": "0"}),
                # Each rank pinned to its own core by the launcher (MPICH's Hydra reads HYDRA_BINDING):
                # whether the scheduler moving the ranks between cores costs the compute.
                Config(f"2 ranks × {half}, bound to cores", TARGET, two, {"HYDRA_BINDING": "core"}),
                # A waiting rank that never sleeps keeps its core awake: whether a core resuming
                # from idle is what makes the 2-rank job's compute slower.
                Config(f"2 ranks × {half}, spinning wait (diagnostic)", TARGET, two, {"PIPEINFER_WAIT_SPIN": "1"}),
                # Both ranks on the same core(s): the stages still alternate, but no core goes idle
                # between them.
                Config(f"2 ranks × {half}, both on cpu(s) 0-{half - 1}", TARGET, two, cpus=f"0-{half - 1}"),
                # What a waiting rank's fine polling costs the rank that computes, without a pipeline:
                # the 1-rank job next to a process that only sleeps 0.1 ms in a loop.
                Config(f"1 rank × {half} + a 10 kHz sleeper", TARGET, one, neighbour="sleeper"),
                # What a busy other core costs the one that computes: whether the two cores
                # share what the compute needs (a physical core under the VM, or a CPU quota).
                Config(f"1 rank × {half} + a busy loop", TARGET, one, neighbour="spinner"),
                # Awake when the message comes: a rank alone on its cores probes without sleeping for
                # up to 10 ms after the predicted sleep (opt-in); and explicitly off, the default.
                Config(f"2 ranks × {half}, spin after the predicted sleep", TARGET, two, {"PIPEINFER_WAIT_SPIN": "tail"}),
                Config(f"2 ranks × {half}, no spin after the predicted sleep", TARGET, two, {"PIPEINFER_WAIT_SPIN": "0"})]
    if suite == "topologies":
        both = ["--modes", "iterative,pipeinfer"]
        return [Config(f"llama.cpp, {cores} threads", PAIR, ["--threads", str(cores)], llamacpp=True),
                Config(f"1 rank × {cores}, draft on the head", PAIR, [*both, "--ranks", "1"]),
                Config(f"1 rank × {cores}, --draft lookup", TARGET, [*both, "--ranks", "1", "--draft", "lookup"]),
                Config("2 stages, draft on the head", PAIR, [*both, "--ranks", "2"]),
                Config("1/1: one stage + a draft rank", PAIR, [*both, "--layer-split", "1/1"]),
                Config("2 stages, --draft lookup", TARGET, [*both, "--ranks", "2", "--draft", "lookup"]),
                Config("3 stages, draft on the head", PAIR, [*both, "--ranks", "3"])]
    if suite == "pages":
        # The engine's buffers with transparent huge pages (the default) and without
        # (PIPEINFER_HUGEPAGES=0), on the shapes of the overhead suite and on all the cores.
        off = {"PIPEINFER_HUGEPAGES": "0"}
        one = ["--modes", "iterative", "--ranks", "1", "--threads", str(half)]
        two = ["--modes", "iterative", "--ranks", "2", "--threads", str(half)]
        wide = ["--modes", "iterative", "--ranks", "1", "--threads", str(cores)]
        return [Config(f"1 rank × {half}, 4 KiB pages", TARGET, one, off),
                Config(f"1 rank × {half}, huge pages", TARGET, one),
                Config(f"2 ranks × {half}, 4 KiB pages", TARGET, two, off),
                Config(f"2 ranks × {half}, huge pages", TARGET, two),
                Config(f"1 rank × {cores}, 4 KiB pages", TARGET, wide, off),
                Config(f"1 rank × {cores}, huge pages", TARGET, wide)]
    if suite == "threads":
        modes = ["--modes", "iterative,pipeinfer", "--ranks", "2"]
        return [Config(f"llama.cpp, {cores} threads", PAIR, ["--threads", str(cores)], llamacpp=True),
                # One rank alone on the cores: the CLI's default wait policy against llama.cpp.
                Config(f"1 rank × {cores}", TARGET, ["--modes", "iterative", "--ranks", "1", "--threads", str(cores)]),
                Config(f"2 ranks × {half}, passive", PAIR, [*modes, "--threads", str(half)]),
                Config(f"2 ranks × {cores}, passive", PAIR, [*modes, "--threads", str(cores)],
                       {"OMP_WAIT_POLICY": "passive"}),
                Config(f"2 ranks × {cores}, spin 10k", PAIR, [*modes, "--threads", str(cores)],
                       {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "10000"}),
                Config(f"2 ranks × {cores}, spin 100k", PAIR, [*modes, "--threads", str(cores)],
                       {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "100000"})]
    if suite == "drafts":
        drafts = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m", "qwen0.5b": "qwen2.5-coder-0.5b-instruct",
                  "lookup+smollm2": "lookup+smollm2-135m-instruct"}
        shapes = {"1 rank": ["--ranks", "1"], "2 stages": ["--ranks", "2"], "3 stages": ["--ranks", "3"],
                  "1/1": ["--layer-split", "1/1"]}
        return [Config(f"{shape}, {short}", TARGET, ["--modes", "iterative,pipeinfer", "--draft", draft, *args])
                for shape, args in shapes.items() for short, draft in drafts.items()]
    raise SystemExit(f"Error: unknown suite {suite!r}; choose one of {', '.join(SUITES)}")


SUITES = ("overhead", "topologies", "threads", "pages", "drafts")


# The neighbour: wakes ten thousand times a second and does nothing else, as a pipeline rank
# polling for a message does in the first 50 ms of a wait.
SLEEPER = "import time\nwhile True:\n    time.sleep(1e-4)"
# The other neighbour never sleeps, as a rank whose waits are busy probe loops.
SPINNER = "while True:\n    pass"
NEIGHBOURS = {"sleeper": SLEEPER, "spinner": SPINNER}


def command(a, c: Config, out: Path) -> list[str]:
    if c.llamacpp:
        return module("llamacpp", c.model, "-n", a.n_predict, "--limit", a.limit, *c.args, "--json", out, *a.prompts)
    pinned = ["taskset", "-c", c.cpus] if c.cpus else []
    args = list(c.args)
    if a.modes and "--modes" in args:  # --modes given: every configuration runs those modes
        args[args.index("--modes") + 1] = a.modes
    return [*pinned, *pipeinfer("bench", c.model, *args, "-n", a.n_predict, "--limit", a.limit, "--warmup", a.warmup,
                                "--repeat", 1, "--temp", 0, "--json", out, *a.prompts, program=a.pipeinfer)]


def run_config(a, c: Config, rnd: int) -> dict:
    out = a.work_dir / f"{a.suite}_{abs(hash(c.label)) % 10**8}_r{rnd}.json"
    cmd = command(a, c, out)
    env_shown = " ".join(f"{k}={v}" for k, v in c.env.items())
    cmd_shown = (env_shown + " " if env_shown else "") + shown(cmd)
    log(f"[round {rnd}] {c.label}: {cmd_shown}")
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOURS[c.neighbour]]) if c.neighbour else None
    try:
        job = run_json(cmd, out, c.env)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    return {"label": c.label, "round": rnd, "command": cmd_shown, **job.kept()}


def records_of(run: dict) -> list[dict]:
    """The measured records of a run, llama.cpp's labelled as mode `llama.cpp`."""
    doc = run.get("doc") or {}
    if "header" not in doc:
        return [{**r, "mode": "llama.cpp", "warmup": False} for r in doc.get("records", [])]
    return [r for r in doc.get("records", []) if not r["warmup"]]


def summarize(configs: list[Config], runs: list[dict]) -> list[dict]:
    """One row per (configuration, mode), with ratios to the first configuration's same mode (or
    its only mode), to the same configuration's `iterative`, and whether the tokens agree."""
    pooled = {c.label: [r for run in runs if run["label"] == c.label for r in records_of(run)] for c in configs}
    ref_tokens: dict[str, list[int]] = {}
    for recs in pooled.values():
        for r in recs:
            if r["mode"] in ("iterative", "llama.cpp"):
                ref_tokens.setdefault(r["prompt_id"], r["tokens"])
    base = pooled[configs[0].label]
    rows = []
    for c in configs:
        recs = pooled[c.label]
        for mode in dict.fromkeys(r["mode"] for r in recs):
            mine = [r for r in recs if r["mode"] == mode]
            base_mode = [r for r in base if r["mode"] == mode] or base
            iterative = [r for r in recs if r["mode"] == "iterative"]
            acc = [r["acceptance"]["rate"] for r in mine if (r.get("acceptance") or {}).get("rate") is not None]
            rows.append({
                "config": c.label, "mode": mode, "n_records": len(mine),
                "tok_per_s": median(r.get("tok_per_s") for r in mine),
                "decode_tok_per_s": median(r.get("decode_tok_per_s") for r in mine),
                "ttft_ms": statistics.median(r["ttft_s"] * 1e3 for r in mine) if mine else None,
                "acceptance": statistics.fmean(acc) if acc else None,
                "x_first": paired_ratio(per_prompt(mine, "tok_per_s"), per_prompt(base_mode, "tok_per_s")),
                "x_first_decode": paired_ratio(per_prompt(mine, "decode_tok_per_s"),
                                               per_prompt(base_mode, "decode_tok_per_s")),
                "x_iterative": paired_ratio(per_prompt(mine, "tok_per_s"), per_prompt(iterative, "tok_per_s"))
                if iterative and mode != "iterative" else None,
                "tokens_same": all(r["tokens"] == ref_tokens.get(r["prompt_id"], r["tokens"]) for r in mine),
            })
    return rows


def table(rows: list[dict], first: str) -> str:
    head = ["configuration", "mode", "tok/s", "decode tok/s", "TTFT ms", "acceptance", f"× {first} (tok/s, decode)",
            "× iterative", "tokens"]
    cells = [[r["config"], r["mode"], fmt(r["tok_per_s"]), fmt(r["decode_tok_per_s"]), fmt(r["ttft_ms"], ".0f"),
              fmt(r["acceptance"] and 100 * r["acceptance"], ".0f", " %"),
              f"{fmt(r['x_first'], '.3f')}, {fmt(r['x_first_decode'], '.3f')}", fmt(r["x_iterative"], ".3f"),
              "same" if r["tokens_same"] else "DIFFERENT"] for r in rows]
    return markdown_table(head, cells, "llrrrrrrl")


# -- reports on earlier runs --------------------------------------------------------------------

def requests_of(doc: dict) -> list[tuple[str, int, dict]]:
    """(configuration label, round, record) of every measured request that has its ranks' figures,
    from this script's JSON or from a `pipeinfer bench --json` document."""
    if "runs" in doc:
        return [(run["label"], run.get("round", 0), r) for run in doc["runs"] for r in measured(run.get("doc"))
                if "ranks" in r]
    label = (doc.get("header") or {}).get("topology", {}).get("layer_split", "job")
    return [(str(label), 0, r) for r in measured(doc) if "ranks" in r]


def cores_report(requests: list[tuple[str, int, dict]], cores: int) -> str:
    groups: dict[tuple[str, str], list[dict]] = {}
    for label, _, rec in requests:
        n, wall_ms = max(rec["n_gen"], 1), (rec["t_end"] - rec["t_start"]) * 1e3
        by_role: dict[str, float] = {}
        for rank in rec["ranks"]:
            by_role[rank["role"]] = by_role.get(rank["role"], 0.0) + rank["cpu_s"] * 1e3
        cpu_ms = sum(by_role.values())
        groups.setdefault((label, rec["mode"]), []).append(
            {"wall": wall_ms / n, "cpu": cpu_ms / n, "busy": cpu_ms / wall_ms if wall_ms > 0 else 0.0,
             "tok_per_s": rec["tok_per_s"], **{role: ms / n for role, ms in by_role.items()}})
    rows = []
    for (label, mode), bs in groups.items():
        med = {k: statistics.median(b[k] for b in bs if k in b) for k in bs[0]}
        parts = " + ".join(f"{med[k]:.0f}" for k in ("head", "stage", "draft") if k in med)
        rows.append([label, mode, fmt(med["tok_per_s"]), fmt(med["wall"], ".1f"), f"{med['cpu']:.1f} ({parts})",
                     fmt(med["busy"]), fmt(cores * 1e3 / med["cpu"], ".1f")])
    return markdown_table(["configuration", "mode", "tok/s", "wall ms/token", "CPU ms/token (head + stages + draft rank)",
                           "cores busy", "bound tok/s"], rows, "llrrlrr")


def overhead_report(files: list[tuple[str, dict]], reference: str | None) -> str:
    splits: dict[str, dict[tuple, dict]] = {}  # label -> (file, round, prompt) -> wall and compute
    for path, doc in files:
        for label, rnd, rec in requests_of(doc):
            wall = rec["t_end"] - rec["t_start"]
            compute = sum(r["engine"]["t_compute_us"] for r in rec["ranks"]) / 1e6
            runs = max(rec["ranks"][0].get("runs", rec["n_gen"]), 1)
            splits.setdefault(label, {})[(path, rnd, rec["prompt_id"])] = {
                "wall": wall, "compute": compute, "rest": (wall - compute) / wall, "rest_ms": (wall - compute) * 1e3 / runs}
    if not splits:
        raise SystemExit("Error: no measured requests in these files; give the JSON of benchmarks/topologies.py")
    ref = reference or next(iter(splits))
    if ref not in splits:
        raise SystemExit(f"Error: --reference {ref!r} is not a configuration of these files")
    rows = []
    for label, got in splits.items():
        shares = [s["rest"] for s in got.values()]
        pairs = [(splits[ref][k], s) for k, s in got.items() if k in splits[ref]]
        speed, comp = [r["wall"] / s["wall"] for r, s in pairs], [r["compute"] / s["compute"] for r, s in pairs]
        geo = lambda xs: math.exp(statistics.fmean(math.log(x) for x in xs))  # noqa: E731
        rows.append([label, str(len(got)), f"{100 * statistics.median(shares):.2f} % ({100 * min(shares):.2f}–"
                     f"{100 * max(shares):.2f} %)", f"{statistics.median(s['rest_ms'] for s in got.values()):.2f}"]
                    + ([f"{geo(speed):.3f} ({min(speed):.2f}–{max(speed):.2f})", f"{geo(comp):.3f} ({min(comp):.2f}–"
                        f"{max(comp):.2f})"] if pairs else ["–", "–"]))
    return markdown_table(["configuration", "requests", "the rest, share of wall time (median, range)", "rest ms per run",
                           f"× {ref}: speed (geomean, range)", f"× {ref}: compute"], rows, "lrlrrr")


def report(a) -> int:
    files = []
    for path in a.files:
        try:
            files.append((str(path), json.loads(path.read_text())))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"Error: cannot read {path}: {exc}; give the JSON of benchmarks/topologies.py") from None
    if a.report == "overhead":
        publish(overhead_report(files, a.reference))
        return 0
    requests = [req for _, doc in files for req in requests_of(doc)]
    if not requests:
        raise SystemExit("Error: no measured pipeinfer requests in the given files")
    publish(cores_report(requests, a.cores))
    return 0


# -- main ---------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=SUITES, help="the configurations to measure")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--limit", type=int, default=3, help="prompts of the set (default 3)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 2, help="cores the jobs have (default: this machine's)")
    ap.add_argument("--prompts", default=None, help="a prompt set or file, given to every run")
    ap.add_argument("--modes", default=None, help="bench's --modes for every configuration (default: each suite's own)")
    ap.add_argument("--only", default=None, help="comma-separated configuration numbers (1-based) to run")
    ap.add_argument("--pipeinfer", default=PIPEINFER)
    ap.add_argument("--work-dir", type=Path, default=ROOT / "build" / "bench_topologies")
    ap.add_argument("--json", type=Path, help="write every figure and the raw bench documents here (required to measure)")
    ap.add_argument("--markdown", type=Path, help="write the table here too")
    ap.add_argument("--report", choices=("cores", "overhead"), help="do not measure: report on the JSON FILES of earlier runs")
    ap.add_argument("--reference", default=None, help="--report overhead: the configuration to pair with (default: the first)")
    ap.add_argument("files", nargs="*", type=Path, help="with --report: this script's (or pipeinfer bench's) JSON")
    a = ap.parse_args(argv)
    if a.report is not None and not a.files:
        ap.error("--report reads the JSON of earlier runs: give one or more files")
    if a.report is None and (a.suite is None or a.json is None or a.files):
        ap.error("to measure, give --suite and --json (and no files); to report on earlier runs, --report and files")
    a.prompts = ["--prompts", a.prompts] if a.prompts else []
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.report is not None:
        return report(a)
    a.work_dir.mkdir(parents=True, exist_ok=True)
    configs = suite_configs(a.suite, a.cores)
    if a.only:
        picked = [int(i) for i in a.only.split(",") if i.strip().isdigit()]
        if not picked or any(not 1 <= i <= len(configs) for i in picked):
            raise SystemExit(f"Error: --only {a.only!r}: give configuration numbers from 1 to {len(configs)}")
        configs = [configs[i - 1] for i in picked]
    runs = []
    for rnd in range(a.rounds):
        for c in (configs if rnd % 2 == 0 else configs[::-1]):
            runs.append(run_config(a, c, rnd))
    rows = summarize(configs, runs)
    doc = {"suite": a.suite, "finished": datetime.now(UTC).isoformat(timespec="seconds"),
           "argv": sys.argv[1:], "rows": rows, "runs": runs}
    publish(table(rows, configs[0].label), doc, a.json, a.markdown)
    return 0 if all("doc" in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
