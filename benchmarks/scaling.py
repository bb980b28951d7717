#!/usr/bin/env python3
"""The scaling curve: one request on N emulated hosts that each have their own CPU and memory.

The machine's CPU is held fixed (--total-cpus, default 2) and divided among the hosts (N hosts x
total/N CPUs, a cgroup quota each: scripts/emulate-cluster.sh up N --cpus C), so that adding a host
adds a node, not cores: `iterative` computes on one host at a time, as on a real cluster, and
cannot borrow the idle hosts' cores. Every rank runs 1 thread (--threads 1).

For each link rate (--rates) and host count (--hosts) it brings a cluster up, then runs each
configuration (--configs) through `pipeinfer bench` as a user runs it, with the same prompts:

    iterative                   plain pipelined decoding
    speculative:DRAFT           synchronous draft-then-verify, the draft on the head
    pipeinfer:DRAFT             asynchronous pipelined speculation, the draft on the head
    pipeinfer:DRAFT@own         the draft on a host of its own: N-1 target stages + 1 draft rank
                                (the PipeInfer paper's 8-node shape is 7 + 1)
    pipeinfer:DRAFT@shared      N target stages + 1 draft rank that shares host 0 with the head:
                                its own process, drafting while the head works, on the head's quota
    auto:DRAFT                  what `generate -M auto --layer-split auto --draft DRAFT` chooses by
                                itself on N ranks with no profile given: mode, settings, placement
                                and threads (the first run of a cluster calibrates quickly and caches
                                the profile; its time is the row's `calibrate s`)

DRAFT is a model name, `lookup`, or `lookup+MODEL`. Every row runs --repeat times (default 3, or
CLUSTER_REPEAT), the rows of one cluster in alternated rounds so that background load hits them
alike; each figure is the median over the runs with its min–max: tok/s (end to end), decode tok/s,
TTFT, acceptance, the busiest host's CPU time and the hosts' throttled time (from their cgroups),
and any --column LABEL=PATH read from the job's JSON records. The run fails (exit 1, each row named
in an `Error:` line) when a row's job fails, or when any text differs from iterative's (the first
iterative record of its prompt, on the fewest hosts). --mem SIZE limits every host's memory: the
rows of a model too large for one host, where one host refuses the job and a split runs.

Needs root (namespaces, tc, cgroups). Prints the table (under a line naming the machine's CPU) on
stdout and to --markdown, progress on stderr, and writes every figure and run to --json.

    sudo .venv/bin/python -m benchmarks.scaling --hosts 1,2,4,8 --rates 1gbit --json build/cluster.json
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.emulated import Cluster, Failure, emulated_cluster, main_guard, on_host, require_root
from benchmarks.figures import first_difference, median, spread
from benchmarks.report import Column, fmt, fmt_spread, publish, render
from benchmarks.runner import PIPEINFER, ROOT, log, pipeinfer, run_json, shown
from benchmarks.scaling_auto import auto_cmd, run_auto

DEFAULT_CONFIGS = ("iterative,speculative:qwen2.5-coder-0.5b-instruct,pipeinfer:qwen2.5-coder-0.5b-instruct,"
                   "pipeinfer:smollm2-135m-instruct,pipeinfer:lookup,pipeinfer:lookup+qwen2.5-coder-0.5b-instruct,"
                   "pipeinfer:smollm2-135m-instruct@own,pipeinfer:qwen2.5-coder-0.5b-instruct-q4_0@own,"
                   "auto:qwen2.5-coder-0.5b-instruct-q4_0")
# What a run keeps of each record of the job's JSON (`pipeinfer bench --json`): the figures below
# and the ranks' own reports, which extra columns read.
RECORD_KEYS = ("prompt_id", "mode", "tokens", "n_prompt", "n_gen", "tok_per_s", "decode_tok_per_s", "ttft_s",
               "acceptance", "ranks", "drafting")


def parse_config(text: str) -> dict:
    mode, _, rest = text.partition(":")
    draft, _, place = rest.partition("@")
    if mode not in ("iterative", "speculative", "pipeinfer", "auto"):
        raise Failure(f"config {text!r}: the mode must be iterative, speculative, pipeinfer or auto")
    if mode != "iterative" and not draft:
        raise Failure(f"config {text!r}: {mode} needs a draft (MODE:DRAFT)")
    if place not in ("", "head", "own", "shared"):
        raise Failure(f"config {text!r}: the placement after @ is head, own or shared")
    if mode == "auto" and place:
        raise Failure(f"config {text!r}: auto chooses the placement itself; drop the @{place}")
    if place in ("own", "shared") and (not draft or draft.startswith("lookup")):
        raise Failure(f"config {text!r}: only a draft model runs as a rank of its own (@{place})")
    placement = "auto" if mode == "auto" else place or ("head" if draft else None)  # auto: the job's choice
    return {"label": text, "mode": mode, "draft": draft or None, "placement": placement}


# -- columns read from the job's JSON --------------------------------------------------------------

@dataclass(frozen=True)
class RecordColumn:
    """A figure read from each record of the job's JSON by a dotted path (`ttft_s`,
    `ranks.0.cpu_s`; `*` adds up a list: `ranks.*.cpu_s`): per run the median over its prompts, per
    row the median over its runs with min–max. `--column LABEL=PATH` adds one."""

    label: str
    path: str

    def of(self, record: dict) -> float | None:
        return _at(record, self.path.split("."))


def _at(value, keys: list[str]) -> float | None:
    if not keys:
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    key, rest = keys[0], keys[1:]
    if key == "*" and isinstance(value, list):
        parts = [x for x in (_at(v, rest) for v in value) if x is not None]
        return sum(parts) if parts else None
    if isinstance(value, list) and key.isdigit():
        return _at(value[int(key)], rest) if int(key) < len(value) else None
    if isinstance(value, dict):
        return _at(value.get(key), rest)
    return None


# Columns every table shows, read from the job's JSON records (a per-rank figure the job reports,
# e.g. RecordColumn("draft CPU s", "ranks.*.draft_cpu_s")); --column adds more for one run.
JOB_COLUMNS: list[RecordColumn] = [RecordColumn("drafted / token", "drafting.proposed_per_committed"),
                                   RecordColumn("head CPU s", "ranks.0.cpu_s"),
                                   RecordColumn("head own s", "ranks.0.cpu_split.own_s")]


def parse_column(text: str) -> RecordColumn:
    label, sep, path = text.partition("=")
    if not sep or not label.strip() or not path.strip():
        raise Failure(f"--column {text!r}: give LABEL=PATH, e.g. 'head CPU s=ranks.0.cpu_s' or 'CPU s=ranks.*.cpu_s'")
    return RecordColumn(label.strip(), path.strip())


# -- one run --------------------------------------------------------------------------------------

def balanced_fractions(model: str, n_stages: int) -> str:
    """--layer-split fractions of the default (byte-balanced) split of n_stages stages."""
    from pipeinfer_cli.models.gguf_info import read_model_info
    from pipeinfer_cli.planner.layer_split import balanced_split, fractions_of
    from pipeinfer_cli.models.model_files import resolve_model
    from pipeinfer_cli.models.registry import load_registry

    info = read_model_info(resolve_model(model, load_registry()).path)
    ranges = balanced_split(info.layer_bytes, n_stages, last_extra=info.output_bytes)
    return ",".join(f"{f:.4f}" for f in fractions_of(ranges, info.n_layer))


def bench_cmd(a, n_hosts: int, cfg: dict, out: Path) -> list[str]:
    ranks = n_hosts + 1 if cfg["placement"] == "shared" else n_hosts
    cmd = pipeinfer("bench", a.model, "--modes", cfg["mode"], "--ranks", ranks, "--threads", 1, "-n", a.n_predict,
                    "--prompts", a.prompts, "--limit", a.limit, "--warmup", 0, "--repeat", 1, "--temp", 0,
                    "--json", out, program=a.pipeinfer)
    if cfg["draft"]:
        cmd += ["--draft", cfg["draft"]]
    if (split := layer_split(a, n_hosts, cfg)) is not None:
        cmd += ["--layer-split", split]
    return cmd + list(a.bench_arg)


def layer_split(a, n_hosts: int, cfg: dict) -> str | None:
    """The --layer-split of a config: a draft on a host of its own takes the last host; a shared
    one is rank N, which Hydra places on host 0 (the hostfile has one slot per host and wraps)."""
    if cfg["placement"] == "own":
        return balanced_fractions(a.model, n_hosts - 1) + "/1"
    if cfg["placement"] == "shared":
        return balanced_fractions(a.model, n_hosts) + "/1"
    return None


def on_cluster(c: Cluster, ranks: int, cmd: list[str]) -> list[str]:
    """One rank runs in the launching process (no MPI relaunch), so it must start on host 0."""
    return on_host(c, 0, cmd) if ranks == 1 else cmd


def run_one(a, c: Cluster, n_hosts: int, rate: str, cfg: dict, mem: str | None, rnd: int) -> dict:
    name = cfg["label"].replace(":", "_").replace("@", "_").replace("+", "_")
    out = a.work_dir / f"{rate}_h{n_hosts}_{name}{'_mem' if mem else ''}_r{rnd}.json"
    cmd = bench_cmd(a, n_hosts, cfg, out)
    ranks = n_hosts + 1 if cfg["placement"] == "shared" else n_hosts
    log(f"[{n_hosts} hosts x {c.cpus[0]:g} CPU, {rate}{', mem ' + mem if mem else ''}, run {rnd + 1}/{a.repeat}] "
        f"{cfg['label']}: {shown(cmd) if cfg['mode'] != 'auto' else shown(auto_cmd(a, n_hosts, cfg, None))}")
    before = c.usage()
    job = run_auto(a, c, n_hosts, cfg) if cfg["mode"] == "auto" else run_json(on_cluster(c, ranks, cmd), out, c.env())
    after = c.usage()
    run = {"round": rnd, "returncode": job.returncode, "wall_s": round(job.wall_s, 1),
           "host_cpu_s": {h: round(after[h]["cpu_s"] - before[h]["cpu_s"], 2) for h in after},
           "host_throttled_s": {h: round(after[h]["throttled_s"] - before[h]["throttled_s"], 2) for h in after},
           "host_mem_peak": {h: after[h]["mem_peak"] for h in after}, "oom": c.memory_failures(before)}
    if job.ok:
        run["records"] = [{k: r.get(k) for k in RECORD_KEYS + ("auto",)} for r in job.doc["records"]]
        run |= run_figures(run["records"], a.columns)
        log(f"  {job.wall_s:.0f} s: {run['tok_per_s']:.2f} tok/s, TTFT {run['ttft_s']:.2f} s")
    else:
        run["error"] = job.error or f"exit status {job.returncode}"
    return run


def run_figures(records: list[dict], columns: list[RecordColumn]) -> dict:
    """One run's figures: medians over prompts of tok/s, decode tok/s, TTFT and each extra column;
    acceptance pooled."""
    med = (lambda k: median(r.get(k) for r in records))  # noqa: E731
    drafted = sum((r.get("acceptance") or {}).get("drafted", 0) for r in records)
    accepted = sum((r.get("acceptance") or {}).get("accepted", 0) for r in records)
    return {"tok_per_s": med("tok_per_s"), "decode_tok_per_s": med("decode_tok_per_s"), "ttft_s": med("ttft_s"),
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "columns": {col.label: median(col.of(r) for r in records) for col in columns}}


# -- rows: the runs of one configuration on one cluster -------------------------------------------

def make_row(c_cpus: float, n_hosts: int, rate: str, mem: str | None, cfg: dict, runs: list[dict], a) -> dict:
    """A row: its configuration, every run, and each figure as a spread over the runs that ran."""
    ran = [r for r in runs if "records" in r]
    row = {"hosts": n_hosts, "cpus_per_host": c_cpus, "rate": rate, "mem_per_host": mem, **cfg,
           "command": f"scripts/emulate-cluster.sh up {n_hosts} --rate {rate} --cpus {c_cpus:g}"
                      f"{' --mem ' + mem if mem else ''}; scripts/emulate-cluster.sh "
                      f"{'on 0' if n_hosts == 1 and cfg['placement'] != 'shared' else 'exec'} -- "
                      f"{shown(auto_cmd(a, n_hosts, cfg, None) if cfg['mode'] == 'auto' else bench_cmd(a, n_hosts, cfg, Path('OUT.json')))}",
           "runs": runs, "failed_runs": [r["error"] for r in runs if "records" not in r]}
    for key in ("tok_per_s", "decode_tok_per_s", "ttft_s", "acceptance"):
        row[f"{key}_spread"] = spread(r[key] for r in ran)
        row[key] = (row[f"{key}_spread"] or {}).get("median")
    row["host_cpu_s_max"] = spread(max(r["host_cpu_s"].values(), default=0) for r in ran) if ran else None
    row["host_throttled_s_sum"] = spread(sum(r["host_throttled_s"].values()) for r in ran) if ran else None
    row["head_host_cpu_ratio"] = spread(x for x in (head_cpu_ratio(r["host_cpu_s"]) for r in ran) if x) if ran else None
    row["columns"] = {col.label: spread(r["columns"].get(col.label) for r in ran) for col in a.columns}
    return row


def head_cpu_ratio(host_cpu_s: dict) -> float | None:
    """The head's host's CPU time over the busiest other host's (the first host is the head's)."""
    if len(host_cpu_s) < 2:
        return None
    head, *others = host_cpu_s.values()
    return round(head / max(others), 3) if max(others) > 0 else None


def check_texts(rows: list[dict]) -> list[str]:
    """Every record of every run against iterative's text of its prompt (the first iterative record
    on the fewest hosts; where no iterative row ran, the first record). Sets each row's
    `texts_identical` (None: it has no text, it failed) and returns one line per difference."""
    ref: dict[str, tuple[list[int], str]] = {}
    ordered = sorted(rows, key=lambda r: (r["mode"] != "iterative", r["hosts"]))
    for r in ordered:
        for run in r.get("runs") or [{"records": r.get("records")}]:
            for rec in run.get("records") or []:
                ref.setdefault(rec["prompt_id"], (rec["tokens"], f"{r['label']} on {r['hosts']} hosts"))
    bad = []
    for r in rows:
        runs = [run for run in r.get("runs") or [{"records": r.get("records")}] if run.get("records")]
        r["texts_identical"] = True if runs else None
        for run in runs:
            for rec in run["records"]:
                tokens, where = ref[rec["prompt_id"]]
                if rec["tokens"] != tokens and r["texts_identical"] is not False:
                    r["texts_identical"] = False
                    bad.append(f"{r['label']} on {r['hosts']} hosts at {r['rate']}: prompt {rec['prompt_id']} differs "
                               f"from {where} at token {first_difference(rec['tokens'], tokens)}")
    return bad


def failures(rows: list[dict]) -> list[str]:
    """One line per row some run of which did not run to its end."""
    return [f"{r['label']} on {r['hosts']} hosts at {r['rate']}{' (mem ' + r['mem_per_host'] + ')' if r.get('mem_per_host') else ''}: "
            f"{len(r['failed_runs'])} of {len(r['runs'])} runs failed: {r['failed_runs'][0]}"
            for r in rows if r.get("failed_runs")]


def speedups(rows: list[dict]) -> None:
    """Each row's tok/s over iterative and over the best speculative row of the same hosts and link."""
    for r in rows:
        same = [x for x in rows if x["hosts"] == r["hosts"] and x["rate"] == r["rate"] and x.get("mem_per_host") == r.get("mem_per_host")
                and x.get("tok_per_s")]
        it = next((x["tok_per_s"] for x in same if x["mode"] == "iterative"), None)
        spec = max((x["tok_per_s"] for x in same if x["mode"] == "speculative"), default=None)
        r["x_iterative"] = round(r["tok_per_s"] / it, 3) if r.get("tok_per_s") and it else None
        r["x_speculative"] = round(r["tok_per_s"] / spec, 3) if r.get("tok_per_s") and spec else None


# -- the table --------------------------------------------------------------------------------------

def _texts(r: dict) -> str:
    if r.get("failed_runs"):
        return f"FAILED ({len(r['failed_runs'])}/{len(r['runs'])} runs): {r['failed_runs'][0]}"
    return {True: "same", False: "DIFFER", None: "–"}[r.get("texts_identical")]


def _plan_error(r: dict) -> str:
    if r.get("predicted_error") is None:
        return "–"
    return f"{r['predicted_error']:+.0%}" + (" (at the measured acceptance)" if "plan_acceptance_given" in r else "")


def columns(extra: list[RecordColumn]) -> list[Column]:
    """The table's columns; a column read from the job's JSON goes before `texts`."""
    return [Column("link", lambda r: r["rate"], "l"), Column("hosts", lambda r: str(r["hosts"])),
            Column("CPU/host", lambda r: f"{r['cpus_per_host']:g}"), Column("mem/host", lambda r: r.get("mem_per_host") or "–", "l"),
            Column("config", lambda r: f"`{r['label'].split('@')[0]}`", "l"),
            Column("draft at", lambda r: r["placement"] or "–", "l"),
            Column("runs", lambda r: str(len(r.get("runs") or []))),
            Column("tok/s", lambda r: fmt_spread(r.get("tok_per_s_spread"))),
            Column("decode", lambda r: fmt_spread(r.get("decode_tok_per_s_spread"))),
            Column("TTFT s", lambda r: fmt_spread(r.get("ttft_s_spread"))),
            Column("accept", lambda r: fmt(r.get("acceptance"), ".2f")),
            Column("× iter", lambda r: fmt(r.get("x_iterative"), ".2f")),
            Column("× spec", lambda r: fmt(r.get("x_speculative"), ".2f")),
            Column("plan tok/s", lambda r: fmt((r.get("predicted") or {}).get("tok_per_s"), ".2f")),
            Column("plan err", _plan_error),
            Column("CPU s (max host)", lambda r: fmt_spread(r.get("host_cpu_s_max"), ".1f")),
            Column("throttled s (sum)", lambda r: fmt_spread(r.get("host_throttled_s_sum"), ".1f")),
            Column("head CPU / other", lambda r: fmt_spread(r.get("head_host_cpu_ratio"), ".2f")),
            *(Column(col.label, lambda r, k=col.label: fmt_spread((r.get("columns") or {}).get(k))) for col in extra),
            Column("texts", _texts, "l")]


def plan_rows(a, c: Cluster, n: int, rows: list[dict]) -> None:
    """The planner against the measurement: `pipeinfer calibrate` on these very hosts (as the job
    runs: --ranks, --threads 1, the row's draft and placement), then `pipeinfer plan` for the row's
    mode, prompts and length; the prediction goes into the row beside the measured figures."""
    profiles: dict[tuple, Path] = {}
    for row in rows:
        if row["label"] not in a.plan or not row.get("tok_per_s"):
            continue
        split = layer_split(a, n, row)
        ranks = n + 1 if row["placement"] == "shared" else n
        model_draft = row["draft"] if row["draft"] and row["draft"] != "lookup" else None
        key = (model_draft, split)  # iterative and lookup rows share a calibration: lookup costs ~nothing
        if key not in profiles:
            out = a.work_dir / f"profile_{row['rate']}_h{n}_{len(profiles)}.json"
            cmd = pipeinfer("calibrate", a.model, "--ranks", ranks, "--threads", 1, "--quick", "--out", out,
                            program=a.pipeinfer)
            cmd += (["--draft", model_draft] if model_draft else []) + (["--layer-split", split] if split else [])
            log(f"  calibrate: {shown(cmd)}")
            job = run_json(on_cluster(c, ranks, cmd), out, c.env())  # the profile is a JSON document too
            if not job.ok:
                row["plan_error"] = job.error or "calibrate failed"
                continue
            row["calibrate_s"] = round(job.wall_s)
            profiles[key] = out
        row["profile"] = str(profiles[key])
        plan_row(a, row, profiles[key], ranks, split)


def plan_row(a, row: dict, profile: Path, ranks: int, split: str | None) -> None:
    cmd = pipeinfer("plan", a.model, "--profile", profile, "--modes", row["mode"], "--ranks", ranks, "--threads", 1,
                    "--prompts", a.prompts, "--limit", a.limit, "-n", a.n_predict, "--json", program=a.pipeinfer)
    cmd += (["--draft", row["draft"]] if row["draft"] else []) + (["--layer-split", split] if split else [])
    job = run_json(cmd, quiet=True)
    if not job.ok and "--acceptance" in (job.error or "") and row.get("acceptance") is not None:
        # A draft of another vocabulary has no recordable chains: plan at the acceptance the run measured.
        row["plan_acceptance_given"] = row["acceptance"]
        job = run_json(cmd + ["--acceptance", str(row["acceptance"])], quiet=True)
    if not job.ok:
        row["plan_error"] = job.error
        log(f"  plan failed: {row['plan_error']}")
        return
    pred = job.doc["modes"][row["mode"]]
    row["predicted"] = {k: pred.get(k) for k in ("tok_per_s", "decode_tok_per_s", "ttft_s", "acceptance")}
    row["predicted_error"] = round(pred["tok_per_s"] / row["tok_per_s"] - 1, 3) if row.get("tok_per_s") else None
    log(f"  plan: {pred['tok_per_s']:.2f} tok/s predicted, {row['tok_per_s']:.2f} measured ({row['predicted_error']:+.0%})")


def run_cluster(a, n: int, rate: str, configs: list[dict], mem: str | None = None) -> list[dict]:
    """One cluster of n hosts: every configuration --repeat times, in rounds (every other one in
    reverse order), then a row per configuration."""
    configs = [cfg for cfg in configs if not (cfg["placement"] == "own" and n < 2)]  # a draft host needs a target host
    runs: dict[str, list[dict]] = {cfg["label"]: [] for cfg in configs}
    with emulated_cluster(a.prefix, a.subnet, n, rate, f"{a.total_cpus / n:g}", mem) as c:
        for rnd in range(a.repeat):
            for cfg in (configs if rnd % 2 == 0 else configs[::-1]):
                runs[cfg["label"]].append(run_one(a, c, n, rate, cfg, mem, rnd))
        rows = [make_row(c.cpus[0], n, rate, mem, cfg, runs[cfg["label"]], a) for cfg in configs]
        if a.plan:
            plan_rows(a, c, n, rows)
    return rows


def campaign(a, rows: list[dict]) -> int:
    """Every link rate and host count, its rows appended to `rows` (kept when a later one fails)."""
    require_root()
    configs = [parse_config(x) for x in a.configs.split(",") if x]
    a.columns = JOB_COLUMNS + [parse_column(x) for x in a.column]
    for rate in a.rates.split(","):
        for n in (int(x) for x in a.hosts.split(",")):
            rows += run_cluster(a, n, rate, configs, a.mem)
    return 0


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--hosts", default="1,2,4,8", help="host counts (default 1,2,4,8)")
    p.add_argument("--rates", default="1gbit", help="link rates, e.g. 1gbit,100mbit")
    p.add_argument("--total-cpus", type=float, default=2.0, help="the CPUs divided among the hosts (default 2)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="MODE[:DRAFT[@own|@shared]],... (default: every mode and draft)")
    p.add_argument("--prompts", default="default", help="bench prompt set: default, grounded or a .jsonl")
    p.add_argument("--limit", type=int, default=2, help="prompts of the set (default 2)")
    p.add_argument("-n", "--n-predict", type=int, default=32)
    p.add_argument("--repeat", type=int, default=int(os.environ.get("CLUSTER_REPEAT", "3")),
                   help="runs of every row, reported as median (min–max) (default 3, or CLUSTER_REPEAT)")
    p.add_argument("--mem", metavar="SIZE", help="a memory limit per host (e.g. 800m): the rows of a model too large "
                                                 "for one host, where one host refuses the job and a split runs")
    p.add_argument("--plan", default="", help="configs to predict with calibrate + plan on the same hosts "
                                               "(comma-separated labels, e.g. iterative,pipeinfer:smollm2-135m-instruct; all: every config)")
    p.add_argument("--column", action="append", default=[], metavar="LABEL=PATH",
                   help="an extra column read from each record of the job's JSON by a dotted path "
                        "(ranks.0.cpu_s; * adds up a list: ranks.*.cpu_s); repeatable")
    p.add_argument("--bench-arg", action="append", default=[], help="extra argument for pipeinfer bench (repeatable)")
    p.add_argument("--prefix", default="pi-cl")
    p.add_argument("--subnet", default="10.214.0.0/24")
    p.add_argument("--json", type=Path, help="write every figure, row and run here")
    p.add_argument("--markdown", type=Path, help="write the table here too")
    p.add_argument("--work-dir", type=Path, default=ROOT / "build" / "cluster", help="where the jobs' JSON goes")
    p.add_argument("--pipeinfer", default=PIPEINFER)
    a = p.parse_args(argv)
    if a.repeat < 1:
        p.error("--repeat takes a number of runs of 1 or more")
    a.plan = set(x for x in a.plan.split(",") if x)
    if "all" in a.plan:
        a.plan = set(a.configs.split(","))
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    a.work_dir.mkdir(parents=True, exist_ok=True)
    a.columns = list(JOB_COLUMNS)
    rows: list[dict] = []
    try:
        status = main_guard(lambda: campaign(a, rows))
    finally:
        bad, failed = check_texts(rows), failures(rows)
        speedups(rows)
        publish(render(columns(a.columns), rows),
                {"prompts": a.prompts, "limit": a.limit, "n_predict": a.n_predict, "repeat": a.repeat,
                 "total_cpus": a.total_cpus, "rows": rows, "failed_rows": failed, "text_differences": bad},
                json_path=a.json, md_path=a.markdown)
    for line in failed:
        log(f"Error: a row failed to run: {line}")
    for line in bad:
        log(f"Error: texts differ: {line}")
    return status or (1 if bad or failed else 0)


if __name__ == "__main__":
    sys.exit(main())
