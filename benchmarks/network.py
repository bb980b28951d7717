#!/usr/bin/env python3
"""Bandwidth benchmark: the decoding modes on emulated hosts joined by rate-limited links, against
the same job over shared memory.

For each number of hosts N (--hosts) it runs, one after the other:
- the shared-memory baseline: `pipeinfer bench MODEL --ranks N ...` on this machine, no emulation;
- the same command on an emulated cluster of N hosts (cluster/, benchmarks/emulated.py; one rank per
  network namespace, MPI over TCP through veth links shaped with tc tbf), once per link rate
  (--rates), the links being reshaped between runs (`emulate-cluster.sh rate RATE`); the rate
  `none` leaves the links unshaped (MPI over TCP through the veths, no bandwidth limit).

Per (hosts, link, mode) it reports the median tok/s, the ratio to the same mode over shared memory
(geometric mean over prompts of the per-prompt median tok/s ratio: paired by prompt), the wire bytes
per generated token (the sum over every link, and what the head receives), and whether the tokens
are identical to the shared-memory run's (every record, warmups included, against the shared-memory
`iterative` record of its prompt). It then checks the bandwidth goal: at 10 Mbit/s every mode
keeps >= 85 % of its shared-memory speed, at 100 Mbit/s >= 95 %, and `pipeinfer` is ahead of
`speculative` at every bandwidth.

What is emulated is bandwidth only: this kernel has no netem, so the links add no latency (round
trips stay well under a millisecond). All hosts share this machine's cores. Runs of one N follow
each other within minutes so that background load hits them alike; --rounds R repeats the whole
sequence R times (every other round in reverse order) and pools the records.

Needs root (network namespaces, veths, tc). Prints a table on stdout, progress on stderr, and writes
every figure plus the raw bench documents to --json.

    sudo .venv/bin/python -m benchmarks.network --limit 2 --json build/bench_network.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.emulated import Cluster, Failure, emulated_cluster, main_guard, options, require_root
from benchmarks.figures import median, paired_ratio, per_prompt
from benchmarks.report import Column, fmt, publish, render
from benchmarks.runner import PIPEINFER, ROOT, log, pipeinfer, run_json, shown
from cluster.hosts import parse_rate

SHM = "shm"  # the link label of the shared-memory baseline
GOAL = {"10mbit": 0.85, "100mbit": 0.95}  # fraction of the shared-memory speed to keep


# -- one bench run ------------------------------------------------------------------------------

def bench_cmd(a, n_hosts: int, json_path: Path) -> list[str]:
    cmd = pipeinfer("bench", a.model, *(["--draft", a.draft] if a.draft else []), "--modes", ",".join(a.modes),
                    "--ranks", n_hosts, "--threads", a.threads, "-n", a.n_predict, "--limit", a.limit,
                    "--warmup", a.warmup, "--repeat", a.repeat, "--json", json_path, program=a.pipeinfer)
    return cmd + list(a.bench_arg)


def run_bench(a, n_hosts: int, link: str, rnd: int, cluster: Cluster | None) -> dict:
    out = a.work_dir / f"h{n_hosts}_{link}_r{rnd}.json"
    cmd = bench_cmd(a, n_hosts, out)
    shown_cmd = shown(cmd) if cluster is None else f"scripts/emulate-cluster.sh {options(a.prefix, a.subnet)} exec -- {shown(cmd)}"
    before = cluster.counters() if cluster is not None else None
    log(f"[{n_hosts} hosts, {link}, round {rnd}] {shown_cmd}")
    job = run_json(cmd, out, cluster.env() if cluster is not None else None)
    run = {"hosts": n_hosts, "link": link, "round": rnd, "command": shown_cmd, **job.kept()}
    if cluster is not None:
        after = cluster.counters()
        # Bytes through the hosts' links at the interface (payload plus TCP/IP and MPI framing, the
        # bench's warmup and the launcher's control traffic): proof that the job used the links.
        run["link_counter_bytes"] = sum(after[h][k] - before[h][k] for h in after for k in after[h])
    if (job.returncode not in (0, 1) or job.doc is None) and not a.keep_going:
        raise Failure(f"bench failed on {n_hosts} hosts, link {link} (exit {job.returncode})")
    log(f"  {job.wall_s:.1f} s, exit {job.returncode}")
    return run


# -- figures ------------------------------------------------------------------------------------

def mode_prompts(records: list[dict], mode: str, key: str = "tok_per_s") -> dict[str, float]:
    """{prompt: median of key over the mode's measured records of that prompt}."""
    return per_prompt((r for r in records if r["mode"] == mode and not r["warmup"]), key)


def reference_tokens(records: list[dict]) -> dict[str, list[int]]:
    """Per prompt, the tokens of the first `iterative` record (else the first record)."""
    ref: dict[str, list[int]] = {}
    for r in sorted(records, key=lambda r: r["mode"] != "iterative"):
        ref.setdefault(r["prompt_id"], r["tokens"])
    return ref


def mode_figures(records: list[dict], mode: str, base: list[dict], ref: dict[str, list[int]]) -> dict:
    rs = [r for r in records if r["mode"] == mode]
    measured = [r for r in rs if not r["warmup"]]
    n_gen = sum(r["n_gen"] for r in measured)
    link_bytes = sum(link["bytes"] for r in measured for link in r["wire"]["links"])
    link_msgs = sum(link["messages"] for r in measured for link in r["wire"]["links"])
    head_bytes = sum(r["wire"]["head_received_bytes_per_token"] * max(r["n_gen"], 1) for r in measured)
    per_link: dict[str, int] = {}
    for r in measured:
        for link in r["wire"]["links"]:
            key = f"{link['from']}->{link['to']}"
            per_link[key] = per_link.get(key, 0) + link["bytes"]
    wait: dict[str, float] = {}
    for r in measured:
        for rank, s in r["wire"]["wait_s"].items():
            wait[rank] = wait.get(rank, 0.0) + s
    rows = [r["wire"]["head_received_bytes_per_row"] for r in measured if r["wire"].get("head_received_bytes_per_row")]
    toks = [r.get("tok_per_s") for r in measured if r.get("tok_per_s")]
    mismatched = sorted({r["prompt_id"] for r in rs if r["prompt_id"] in ref and r["tokens"] != ref[r["prompt_id"]]})
    return {
        "n_records": len(measured), "n_gen": n_gen,
        "tok_per_s_median": median(toks),
        "tok_per_s_min": min(toks) if toks else None, "tok_per_s_max": max(toks) if toks else None,
        "per_prompt_tok_per_s": mode_prompts(records, mode),
        "x_shm": paired_ratio(mode_prompts(records, mode), mode_prompts(base, mode)),
        "x_shm_decode": paired_ratio(mode_prompts(records, mode, "decode_tok_per_s"),
                                     mode_prompts(base, mode, "decode_tok_per_s")),
        "wire_bytes_per_token": link_bytes / n_gen if n_gen else None,
        "wire_messages_per_token": link_msgs / n_gen if n_gen else None,
        "wire_bytes_per_token_by_link": {k: v / n_gen for k, v in per_link.items()} if n_gen else {},
        "head_received_bytes_per_token": head_bytes / n_gen if n_gen else None,
        "head_received_bytes_per_row_median": median(rows),
        "wait_s_by_rank": {k: round(v, 3) for k, v in wait.items()},
        "tokens_same_as_shm": not mismatched, "prompts_differing_from_shm": mismatched,
    }


def summarize(a, runs: list[dict]) -> list[dict]:
    """One row per (hosts, link): every round's records pooled, figures per mode."""
    rows = []
    first_shm = next((r for r in runs if r["link"] == SHM and "doc" in r), None)
    global_ref = reference_tokens(first_shm["doc"]["records"]) if first_shm else {}
    for n in a.hosts:
        base = [rec for r in runs if r["hosts"] == n and r["link"] == SHM and "doc" in r for rec in r["doc"]["records"]]
        ref = reference_tokens(base)
        for link in [SHM, *a.rates]:
            mine = [r for r in runs if r["hosts"] == n and r["link"] == link]
            records = [rec for r in mine if "doc" in r for rec in r["doc"]["records"]]
            row = {"hosts": n, "link": link, "rounds": len(mine),
                   "failed_runs": sum("doc" not in r for r in mine),
                   "tokens_identical_within_runs": all(r["doc"]["tokens_identical"] for r in mine if "doc" in r),
                   "tokens_same_as_first_shm": all(rec["tokens"] == global_ref.get(rec["prompt_id"], rec["tokens"])
                                                   for rec in records),
                   "link_counter_bytes": sum(r.get("link_counter_bytes", 0) for r in mine) if link != SHM else None,
                   "modes": {m: mode_figures(records, m, base, ref) for m in a.modes if records}}
            if "pipeinfer" in row["modes"] and "speculative" in row["modes"]:
                row["pipeinfer_x_speculative"] = paired_ratio(mode_prompts(records, "pipeinfer"),
                                                              mode_prompts(records, "speculative"))
            rows.append(row)
    return rows


def goal_check(rows: list[dict]) -> list[dict]:
    checks = []
    for row in rows:
        need = GOAL.get(row["link"])
        for m, f in row["modes"].items():
            if need is not None and f["x_shm"] is not None:
                checks.append({"hosts": row["hosts"], "link": row["link"], "mode": m,
                               "what": f">= {need:.0%} of shared memory", "value": round(f["x_shm"], 3),
                               "met": f["x_shm"] >= need})
        if row.get("pipeinfer_x_speculative") is not None:
            checks.append({"hosts": row["hosts"], "link": row["link"], "mode": "pipeinfer",
                           "what": "ahead of speculative", "value": round(row["pipeinfer_x_speculative"], 3),
                           "met": row["pipeinfer_x_speculative"] > 1.0})
        for m, f in row["modes"].items():
            checks.append({"hosts": row["hosts"], "link": row["link"], "mode": m, "what": "tokens as over shared memory",
                           "value": f["tokens_same_as_shm"], "met": f["tokens_same_as_shm"]})
    return checks


# -- output -------------------------------------------------------------------------------------

LINKS = {SHM: "shared memory", "none": "TCP, unshaped"}


def table(rows: list[dict], modes: list[str]) -> str:
    """One line per (hosts, link, mode)."""
    lines = [{"row": row, "mode": m, "f": row["modes"].get(m)} for row in rows for m in modes]
    fig = (lambda key, spec, suffix="": lambda x: fmt((x["f"] or {}).get(key), spec, suffix))  # noqa: E731
    cols = [Column("hosts", lambda x: str(x["row"]["hosts"]), "l"),
            Column("link", lambda x: LINKS.get(x["row"]["link"], x["row"]["link"]), "l"),
            Column("mode", lambda x: f"`{x['mode']}`", "l"),
            Column("tok/s", lambda x: fmt((x["f"] or {}).get("tok_per_s_median"), ".1f") if x["f"] else "failed"),
            Column("× shm", fig("x_shm", ".2f", "×")), Column("decode × shm", fig("x_shm_decode", ".2f", "×")),
            Column("B/tok (all links)", fig("wire_bytes_per_token", ",.0f")),
            Column("B/tok (head in)", fig("head_received_bytes_per_token", ",.0f")),
            Column("head B/row", fig("head_received_bytes_per_row_median", ".0f")),
            Column("tokens vs shm", lambda x: "" if not x["f"] else "same" if x["f"]["tokens_same_as_shm"] else "DIFFER"),
            Column("pipeinfer × spec.", lambda x: fmt(x["row"].get("pipeinfer_x_speculative"), ".2f", "×")
                   if x["mode"] == "pipeinfer" else "")]
    return render(cols, lines)


def goal_text(checks: list[dict]) -> str:
    out = []
    for c in checks:
        if c["what"].startswith("tokens") and c["met"]:
            continue  # listed only when they differ
        out.append(f"{'met    ' if c['met'] else 'NOT met'}  {c['hosts']} hosts, {c['link']:>7}, {c['mode']:<11} "
                   f"{c['what']}: {c['value']}")
    if all(c["met"] for c in checks if c["what"].startswith("tokens")):
        out.append("met      every record's tokens equal the shared-memory run's")
    return "\n".join(out)


def measure(a, runs: list[dict]) -> int:
    """Every (hosts, round, link) in turn, its runs appended to `runs`; one cluster per host count."""
    require_root()
    for r in a.rates:
        parse_rate(r)
    a.work_dir.mkdir(parents=True, exist_ok=True)
    for n in a.hosts:
        with emulated_cluster(a.prefix, a.subnet, n, a.rates[0]) as cluster:
            for rnd in range(a.rounds):
                order = [SHM, *a.rates]
                for link in (order if rnd % 2 == 0 else order[::-1]):
                    if link == SHM:
                        runs.append(run_bench(a, n, SHM, rnd, None))
                        continue
                    if cluster.rate != link:
                        log(f"scripts/emulate-cluster.sh {options(a.prefix, a.subnet)} rate {link}")
                        cluster.set_rate(link)
                    runs.append(run_bench(a, n, link, rnd, cluster))
    return 0


# -- main ---------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="target model (registry name, pair or .gguf)")
    ap.add_argument("--draft", default="smollm2-135m-instruct", help="draft model, 'lookup', or '' for the pair's own")
    ap.add_argument("--modes", default="iterative,speculative,pipeinfer", type=lambda s: s.split(","))
    ap.add_argument("--hosts", default="2,3", type=lambda s: [int(x) for x in s.split(",")],
                    help="numbers of hosts (= ranks), comma-separated")
    ap.add_argument("--rates", default="1gbit,100mbit,10mbit", type=lambda s: s.split(","),
                    help="link rates, comma-separated (tc rates)")
    ap.add_argument("--threads", type=int, default=1, help="threads per rank")
    ap.add_argument("-n", "--n-predict", type=int, default=32)
    ap.add_argument("--limit", type=int, default=2, help="the first N prompts of the shipped set")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every (hosts, link) this many times, every other round in reverse order; records pooled")
    ap.add_argument("--bench-arg", action="append", default=[], help="extra argument for pipeinfer bench (repeatable)")
    ap.add_argument("--prefix", default="pi-bnet", help="emulated cluster prefix (only its objects are touched)")
    ap.add_argument("--subnet", default="10.215.0.0/24")
    ap.add_argument("--json", type=Path, default=ROOT / "build" / "bench_network.json")
    ap.add_argument("--markdown", type=Path, nargs="?", metavar="FILE", help="the table is always printed; FILE: write the table here too")
    ap.add_argument("--from-json", type=Path, help="do not measure: print the table of an earlier --json")
    ap.add_argument("--keep-going", action="store_true", help="record a failed bench run and go on")
    a = ap.parse_args(argv)
    a.pipeinfer = PIPEINFER
    a.work_dir = a.json.with_suffix("")  # the raw bench documents of every run
    a.work_dir = a.work_dir.parent / (a.work_dir.name + ".runs")

    if a.from_json:
        try:
            doc = json.loads(a.from_json.read_text())  # figures recomputed from the raw bench documents
        except (OSError, ValueError) as e:
            log(f"Error: cannot read {a.from_json}: {e}; give the --json of an earlier run")
            return 1
        cfg = argparse.Namespace(**doc["config"])
        runs = [{k: v for k, v in r.items() if k != "bench"} | ({"doc": r["bench"]} if "bench" in r else {})
                for r in doc["runs"]]
        rows = summarize(cfg, runs)
        publish(table(rows, cfg.modes), md_path=a.markdown, notes=[goal_text(goal_check(rows))])
        return 0

    started = datetime.now(UTC)
    runs: list[dict] = []
    t0 = time.monotonic()
    status = main_guard(lambda: measure(a, runs))
    if status != 0:
        return status
    wall = time.monotonic() - t0
    rows = summarize(a, runs)
    checks = goal_check(rows)
    doc = {
        "schema": "pipeinfer-bench-network/1",
        "started": started.isoformat(timespec="seconds"), "wall_s": round(wall, 1),
        "command": shown([sys.executable, *sys.argv]) if argv is None else shown(argv),
        "config": {k: getattr(a, k) for k in ("model", "draft", "modes", "hosts", "rates", "threads", "n_predict",
                                              "limit", "warmup", "repeat", "rounds", "bench_arg", "prefix", "subnet")},
        "note": "bandwidth only: links are rate-limited with tc tbf, no latency is added (no netem); "
                "every host shares this machine's cores",
        "rows": rows, "goal": checks,
        "runs": [{k: v for k, v in r.items() if k != "doc"} | ({"bench": r["doc"]} if "doc" in r else {})
                 for r in runs],
    }
    publish(table(rows, a.modes), doc, a.json, a.markdown,
            notes=[goal_text(checks), f"{len(runs)} bench runs in {wall / 60:.1f} min."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
