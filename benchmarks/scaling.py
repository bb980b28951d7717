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

DRAFT is a model name, `lookup`, or `lookup+MODEL`. Per row it reports tok/s (end to end), decode
tok/s, TTFT, acceptance, each host's CPU time and throttled time (from its cgroup), and checks that
every text equals the reference (the first iterative record of its prompt, on the fewest hosts):
any difference makes the run fail (exit 1). --mem SIZE limits every host's memory: the rows of a
model too large for one host, where one host refuses the job and a split runs.

Needs root (namespaces, tc, cgroups). Prints a table on stdout, progress on stderr, and writes every
figure and the raw bench documents to --json.

    sudo .venv/bin/python scripts/bench_cluster.py --hosts 1,2,4,8 --rates 1gbit --json build/cluster.json
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from benchlib import (PIPEINFER, ROOT, emulated_cluster, fmt, log, main_guard, markdown_table, median, run_json,
                      run_stdout_json, shown, write_json)
from emulate_cluster import Cluster, Failure, require_root

DEFAULT_CONFIGS = ("iterative,speculative:qwen2.5-coder-0.5b-instruct,pipeinfer:qwen2.5-coder-0.5b-instruct,"
                   "pipeinfer:smollm2-135m-instruct,pipeinfer:lookup,pipeinfer:lookup+qwen2.5-coder-0.5b-instruct,"
                   "pipeinfer:smollm2-135m-instruct@own")


def parse_config(text: str) -> dict:
    mode, _, rest = text.partition(":")
    draft, _, place = rest.partition("@")
    if mode not in ("iterative", "speculative", "pipeinfer"):
        raise Failure(f"config {text!r}: the mode must be iterative, speculative or pipeinfer")
    if mode != "iterative" and not draft:
        raise Failure(f"config {text!r}: {mode} needs a draft (MODE:DRAFT)")
    if place not in ("", "head", "own", "shared"):
        raise Failure(f"config {text!r}: the placement after @ is head, own or shared")
    if place in ("own", "shared") and (not draft or draft.startswith("lookup")):
        raise Failure(f"config {text!r}: only a draft model runs as a rank of its own (@{place})")
    return {"label": text, "mode": mode, "draft": draft or None, "placement": place or ("head" if draft else None)}


def balanced_fractions(model: str, n_stages: int) -> str:
    """--layer-split fractions of the default (byte-balanced) split of n_stages stages."""
    from pipeinfer_cli.models.gguf_info import read_model_info
    from pipeinfer_cli.models.layer_split import balanced_split, fractions_of
    from pipeinfer_cli.models.model_files import resolve_model
    from pipeinfer_cli.models.registry import load_registry

    info = read_model_info(resolve_model(model, load_registry()).path)
    ranges = balanced_split(info.layer_bytes, n_stages, last_extra=info.output_bytes)
    return ",".join(f"{f:.4f}" for f in fractions_of(ranges, info.n_layer))


def bench_cmd(a, n_hosts: int, cfg: dict, out: Path) -> list[str]:
    ranks = n_hosts + 1 if cfg["placement"] == "shared" else n_hosts
    cmd = [a.pipeinfer, "bench", a.model, "--modes", cfg["mode"], "--ranks", str(ranks), "--threads", "1",
           "-n", str(a.n_predict), "--prompts", a.prompts, "--limit", str(a.limit), "--warmup", "0",
           "--repeat", "1", "--temp", "0", "--json", str(out)]
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


def run_one(a, c: Cluster, n_hosts: int, rate: str, cfg: dict, mem: str | None) -> dict:
    out = a.work_dir / f"{rate}_h{n_hosts}_{cfg['label'].replace(':', '_').replace('@', '_').replace('+', '_')}" \
                       f"{'_mem' if mem else ''}.json"
    cmd = bench_cmd(a, n_hosts, cfg, out)
    log(f"[{n_hosts} hosts x {c.cpus[0]:g} CPU, {rate}{', mem ' + mem if mem else ''}] {cfg['label']}: {shown(cmd)}")
    # One host: the job runs in the launching process (no MPI relaunch), so it must start on host 0.
    run = [str(c.wrapper), c.host(0), shlex.join(cmd)] if n_hosts == 1 and cfg["placement"] != "shared" else cmd
    before = c.usage()
    job = run_json(run, out, c.env())
    after = c.usage()
    row = {"hosts": n_hosts, "cpus_per_host": c.cpus[0], "rate": rate, "mem_per_host": mem, **cfg,
           "command": f"scripts/emulate-cluster.sh up {n_hosts} --rate {rate} --cpus {c.cpus[0]:g}"
                      f"{' --mem ' + mem if mem else ''}; scripts/emulate-cluster.sh {'on 0' if n_hosts == 1 else 'exec'} -- {shown(cmd)}",
           "returncode": job.returncode, "wall_s": round(job.wall_s, 1),
           "host_cpu_s": {h: round(after[h]["cpu_s"] - before[h]["cpu_s"], 2) for h in after},
           "host_throttled_s": {h: round(after[h]["throttled_s"] - before[h]["throttled_s"], 2) for h in after},
           "host_mem_peak": {h: after[h]["mem_peak"] for h in after},
           "oom": c.memory_failures(before)}
    if job.doc is not None:
        row["records"] = [{k: r.get(k) for k in ("prompt_id", "mode", "tokens", "n_prompt", "n_gen", "tok_per_s",
                                                  "decode_tok_per_s", "ttft_s", "acceptance", "ranks")}
                          for r in job.doc["records"]]
    else:
        row["error"] = job.error
    figures(row)
    if "records" in row:
        log(f"  {job.wall_s:.0f} s: {row['tok_per_s']:.2f} tok/s, TTFT {row['ttft_s']:.2f} s, "
            f"acceptance {row['acceptance'] if row['acceptance'] is not None else '-'}; "
            f"throttled {sum(row['host_throttled_s'].values()):.1f} s over the hosts")
    return row


def figures(row: dict) -> None:
    """Per row: medians over prompts of tok/s, decode tok/s and TTFT; acceptance pooled."""
    recs = row.get("records") or []
    med = (lambda k: median(r.get(k) for r in recs))  # noqa: E731
    row["tok_per_s"], row["decode_tok_per_s"], row["ttft_s"] = med("tok_per_s"), med("decode_tok_per_s"), med("ttft_s")
    drafted = sum((r.get("acceptance") or {}).get("drafted", 0) for r in recs)
    accepted = sum((r.get("acceptance") or {}).get("accepted", 0) for r in recs)
    row["acceptance"] = round(accepted / drafted, 3) if drafted else None


def check_texts(rows: list[dict]) -> list[str]:
    """Every record's tokens against the reference of its prompt: the first iterative record on the
    fewest hosts (else the first record). Returns one line per difference."""
    ref: dict[str, tuple[list[int], str]] = {}
    ordered = sorted((r for r in rows if "records" in r), key=lambda r: (r["mode"] != "iterative", r["hosts"]))
    for r in ordered:
        for rec in r["records"]:
            ref.setdefault(rec["prompt_id"], (rec["tokens"], f"{r['label']} on {r['hosts']} hosts"))
    bad = []
    for r in rows:
        r["texts_identical"] = True
        for rec in r.get("records", []):
            tokens, where = ref[rec["prompt_id"]]
            if rec["tokens"] != tokens:
                r["texts_identical"] = False
                first = next((i for i, (x, y) in enumerate(zip(rec["tokens"], tokens)) if x != y), min(len(rec["tokens"]), len(tokens)))
                bad.append(f"{r['label']} on {r['hosts']} hosts at {r['rate']}: prompt {rec['prompt_id']} differs from "
                           f"{where} at token {first}")
    return bad


def speedups(rows: list[dict]) -> None:
    """Each row's tok/s over iterative and over the best speculative row of the same hosts and link."""
    for r in rows:
        same = [x for x in rows if x["hosts"] == r["hosts"] and x["rate"] == r["rate"] and x.get("mem_per_host") == r.get("mem_per_host")
                and x.get("tok_per_s")]
        it = next((x["tok_per_s"] for x in same if x["mode"] == "iterative"), None)
        spec = max((x["tok_per_s"] for x in same if x["mode"] == "speculative"), default=None)
        r["x_iterative"] = round(r["tok_per_s"] / it, 3) if r.get("tok_per_s") and it else None
        r["x_speculative"] = round(r["tok_per_s"] / spec, 3) if r.get("tok_per_s") and spec else None


def table(rows: list[dict]) -> str:
    head = ["link", "hosts", "CPU/host", "mem/host", "config", "draft at", "tok/s", "decode", "TTFT s", "accept",
            "× iter", "× spec", "plan tok/s", "plan err", "CPU s (max host)", "throttled s (sum)", "texts"]
    lines = []
    for r in rows:
        cells = [r["rate"], str(r["hosts"]), f"{r['cpus_per_host']:g}", r.get("mem_per_host") or "–", f"`{r['label'].split('@')[0]}`",
                 r["placement"] or "–"]
        if "records" not in r:
            lines.append(cells + [f"cannot run: {r.get('error', '')}"] + [""] * (len(head) - 8))
            continue
        cells += [fmt(r["tok_per_s"], ".2f"), fmt(r["decode_tok_per_s"], ".2f"), fmt(r["ttft_s"], ".2f"),
                  fmt(r["acceptance"], ".2f"), fmt(r.get("x_iterative"), ".2f"), fmt(r.get("x_speculative"), ".2f"),
                  fmt((r.get("predicted") or {}).get("tok_per_s"), ".2f"),
                  "–" if r.get("predicted_error") is None else f"{r['predicted_error']:+.0%}"
                  + (" (at the measured acceptance)" if "plan_acceptance_given" in r else ""),
                  f"{max(r['host_cpu_s'].values()):.1f}", f"{sum(r['host_throttled_s'].values()):.1f}",
                  "same" if r.get("texts_identical") else "DIFFER"]
        lines.append(cells)
    return markdown_table(head, lines, "l" * 6 + "r" * (len(head) - 7) + "l")


def plan_rows(a, c: Cluster, n: int, rows: list[dict]) -> None:
    """The planner against the measurement: `pipeinfer calibrate` on these very hosts (as the job
    runs: --ranks, --threads 1, the row's draft and placement), then `pipeinfer plan` for the row's
    mode, prompts and length; the prediction goes into the row beside the measured figures."""
    profiles: dict[tuple, Path] = {}
    for row in rows:
        if row["label"] not in a.plan or "records" not in row:
            continue
        split = layer_split(a, n, row)
        ranks = n + 1 if row["placement"] == "shared" else n
        model_draft = row["draft"] if row["draft"] and row["draft"] != "lookup" else None
        key = (model_draft, split)  # iterative and lookup rows share a calibration: lookup costs ~nothing
        if key not in profiles:
            out = a.work_dir / f"profile_{row['rate']}_h{n}_{len(profiles)}.json"
            cmd = [a.pipeinfer, "calibrate", a.model, "--ranks", str(ranks), "--threads", "1", "--quick", "--out", str(out)]
            cmd += (["--draft", model_draft] if model_draft else []) + (["--layer-split", split] if split else [])
            run = [str(c.wrapper), c.host(0), shlex.join(cmd)] if ranks == 1 else cmd
            log(f"  calibrate: {shown(cmd)}")
            job = run_json(run, out, c.env())  # the profile is a JSON document too
            if job.returncode != 0 or job.doc is None:
                row["plan_error"] = job.error or "calibrate failed"
                continue
            row["calibrate_s"] = round(job.wall_s)
            log(f"  calibrated in {row['calibrate_s']} s")
            profiles[key] = out
        row["profile"] = str(profiles[key])
        plan_row(a, row, profiles[key], ranks, split)


def plan_row(a, row: dict, profile: Path, ranks: int, split: str | None) -> None:
    cmd = [a.pipeinfer, "plan", a.model, "--profile", str(profile), "--modes", row["mode"], "--ranks", str(ranks),
           "--threads", "1", "--prompts", a.prompts, "--limit", str(a.limit), "-n", str(a.n_predict), "--json"]
    cmd += (["--draft", row["draft"]] if row["draft"] else []) + (["--layer-split", split] if split else [])
    plan, error = run_stdout_json(cmd)
    if plan is None and "--acceptance" in error and row.get("acceptance") is not None:
        # A draft of another vocabulary has no recordable chains: plan at the acceptance the run measured.
        row["plan_acceptance_given"] = row["acceptance"]
        plan, error = run_stdout_json(cmd + ["--acceptance", str(row["acceptance"])])
    if plan is None:
        row["plan_error"] = error
        log(f"  plan failed: {row['plan_error']}")
        return
    pred = plan["modes"][row["mode"]]
    row["predicted"] = {k: pred.get(k) for k in ("tok_per_s", "decode_tok_per_s", "ttft_s", "acceptance")}
    row["predicted_error"] = round(pred["tok_per_s"] / row["tok_per_s"] - 1, 3) if row.get("tok_per_s") else None
    log(f"  plan: {pred['tok_per_s']:.2f} tok/s predicted, {row['tok_per_s']:.2f} measured "
        f"({row['predicted_error']:+.0%})")


def run_cluster(a, n: int, rate: str, configs: list[dict], mem: str | None = None) -> list[dict]:
    rows = []
    with emulated_cluster(a.prefix, a.subnet, n, rate, f"{a.total_cpus / n:g}", mem) as c:
        for cfg in configs:
            if cfg["placement"] == "own" and n < 2:
                continue  # a draft host needs a target host beside it
            rows.append(run_one(a, c, n, rate, cfg, mem))
        if a.plan:
            plan_rows(a, c, n, rows)
    return rows


def campaign(a, rows: list[dict]) -> int:
    """Every link rate and host count, its rows appended to `rows` (kept when a later one fails)."""
    require_root()
    configs = [parse_config(x) for x in a.configs.split(",") if x]
    for rate in a.rates.split(","):
        for n in (int(x) for x in a.hosts.split(",")):
            rows += run_cluster(a, n, rate, configs, a.mem)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--hosts", default="1,2,4,8", help="host counts (default 1,2,4,8)")
    p.add_argument("--rates", default="1gbit", help="link rates, e.g. 1gbit,100mbit")
    p.add_argument("--total-cpus", type=float, default=2.0, help="the CPUs divided among the hosts (default 2)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="MODE[:DRAFT[@own|@shared]],... (default: every mode and draft)")
    p.add_argument("--prompts", default="default", help="bench prompt set: default, grounded or a .jsonl")
    p.add_argument("--limit", type=int, default=2, help="prompts of the set (default 2)")
    p.add_argument("-n", "--n-predict", type=int, default=32)
    p.add_argument("--mem", metavar="SIZE", help="a memory limit per host (e.g. 800m): the rows of a model too large "
                                                 "for one host, where one host refuses the job and a split runs")
    p.add_argument("--plan", default="", help="configs to predict with calibrate + plan on the same hosts "
                                               "(comma-separated labels, e.g. iterative,pipeinfer:smollm2-135m-instruct; all: every config)")
    p.add_argument("--bench-arg", action="append", default=[], help="extra argument for pipeinfer bench (repeatable)")
    p.add_argument("--prefix", default="pi-cl")
    p.add_argument("--subnet", default="10.214.0.0/24")
    p.add_argument("--json", type=Path, help="write every figure and row here")
    p.add_argument("--pipeinfer", default=PIPEINFER)
    a = p.parse_args(argv)
    a.plan = set(x for x in a.plan.split(",") if x)
    if "all" in a.plan:
        a.plan = set(a.configs.split(","))
    a.work_dir = ROOT / "build" / "cluster"
    a.work_dir.mkdir(parents=True, exist_ok=True)

    rows: list[dict] = []
    try:
        status = main_guard(lambda: campaign(a, rows))
    finally:
        bad = check_texts(rows)
        speedups(rows)
        print(table(rows))
        write_json(a.json, {"prompts": a.prompts, "limit": a.limit, "n_predict": a.n_predict,
                            "total_cpus": a.total_cpus, "rows": rows, "text_differences": bad})
    for line in bad:
        log(f"Error: texts differ: {line}")
    return status or (1 if bad else 0)


if __name__ == "__main__":
    sys.exit(main())
