"""`pipeinfer serve` losing a node on emulated hosts with their own CPU (root): the answers of
requests in flight and queued when a rank is killed, or a host's link taken down, against the
fault-free answers of the same server, and how long the server went without a pipeline.

For each fault and each --parallel: one server on N hosts; the requests (two streamed, one queued
with --parallel 2) are sent once with nothing failing, then again with the fault injected after the
first stream's 20th event. A row counts the answers equal to the fault-free ones, the longest time
the faulted stream went without text from the fault on, the seconds the server counted without a
pipeline, the restarts, and whether anything of the old job was left. Any answer that
differs, or a server that exits, fails the campaign (exit 1).

    python -m benchmarks.serve_recovery --hosts 4 --cpus 0.5 --json build/serve_recovery.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.emulated import emulated_cluster, main_guard
from benchmarks.report import Column, fmt, publish, render
from benchmarks.runner import log, pipeinfer
from benchmarks.served import Server, free_port

ASKS = [{"messages": [{"role": "user", "content": "Write a Python function that parses a CSV line with quotes."}]},
        {"messages": [{"role": "user", "content": "Explain what a B-tree is, step by step."}]},
        {"prompt": "def quicksort(xs):", "temperature": 0.7, "seed": 3}]


def stream(server: Server, ask: dict, n_tokens: int, on_event=None) -> tuple[str, list[float]]:
    """The streamed text of one request and when each event arrived."""
    path = "/v1/chat/completions" if "messages" in ask else "/v1/completions"
    body = json.dumps({**ask, "max_tokens": n_tokens, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=body,
                                 headers={"Content-Type": "application/json"})
    text, times = "", []
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                raise RuntimeError(f"error event: {d['error']['message']}")
            for c in d.get("choices", []):
                text += (c.get("delta", {}).get("content") or "") if "messages" in ask else c.get("text", "")
            times.append(time.monotonic())
            if on_event is not None:
                on_event(len(times))
    return text, times


def all_at_once(server: Server, n_tokens: int, fault=None) -> tuple[list[str], list[list[float]]]:
    texts: list = [None] * len(ASKS)
    times: list = [None] * len(ASKS)
    errors: list[str] = []

    def run(i: int) -> None:
        try:
            hook = (lambda n: fault() if n == 20 else None) if i == 0 and fault else None
            texts[i], times[i] = stream(server, ASKS[i], n_tokens, hook)
        except Exception as e:  # noqa: BLE001 - reported as the row's failure
            errors.append(f"request {i}: {e}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ASKS))]
    for t in threads:
        t.start()
        time.sleep(0.5)  # in order: the first ones run, the last waits
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return texts, times


def one_row(c, args, fault: str, parallel: int, out: Path) -> dict:
    port = free_port()
    cmd = pipeinfer("serve", args.model, "--ranks", str(args.hosts), "--parallel", str(parallel), "--port", str(port),
                    "--rank-timeout", str(args.rank_timeout), *(["--draft", args.draft] if args.draft else []))
    log(" ".join(cmd))
    server = Server(cmd, {**os.environ, **c.env()}, port, out / f"serve-{fault}-p{parallel}.err")
    row = {"fault": fault, "parallel": parallel, "hosts": args.hosts}
    try:
        server.wait_health()
        reference, _ = all_at_once(server, args.n)
        old_pids = _job_pids(c, args.hosts)
        injected: list[float] = []

        def inject() -> None:
            injected.append(time.monotonic())
            if fault == "kill":
                pid = _rank_pid(c, args.hosts - 1)
                os.kill(pid, signal.SIGKILL)
            else:
                subprocess.run(["ip", "netns", "exec", c.host(args.hosts - 2), "ip", "link", "set", "eth0", "down"],
                               check=True)

        answers, times = all_at_once(server, args.n, inject)
        t_fault = injected[0]
        after = [t_fault] + [t for t in times[0] if t > t_fault]  # the faulted stream's events from the fault on
        silence = max((b - a for a, b in zip(after, after[1:])), default=None)
        status, metrics = server.get("/metrics")
        row.update({
            "same": sum(a == r for a, r in zip(answers, reference)), "requests": len(ASKS),
            "longest_silence_s": round(silence, 2) if silence is not None else None,
            "restarts": _metric(metrics, "pipeinfer_restarts"),
            "without_pipeline_s": _metric(metrics, "pipeinfer_seconds_without_pipeline"),
            "old_job_left": sorted(set(old_pids) & set(_job_pids(c, args.hosts))),
            "health": json.loads(server.get("/health")[1] or "{}"),
        })
    except RuntimeError as e:
        row["error"] = str(e)
    finally:
        server.stop()
        if fault == "link":
            subprocess.run(["ip", "netns", "exec", c.host(args.hosts - 2), "ip", "link", "set", "eth0", "up"],
                           capture_output=True)
    return row


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _job_pids(c, n: int) -> list[int]:
    pids = []
    for k in range(n):
        r = subprocess.run(["ip", "netns", "pids", c.host(k)], capture_output=True, text=True)
        pids += [int(p) for p in r.stdout.split()]
    return pids


def _rank_pid(c, rank: int) -> int:
    for pid in _job_pids(c, rank + 1):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if f"PMI_RANK={rank}\0".encode() in env and comm == "python":
            return pid
    raise RuntimeError(f"rank {rank} not found")


COLUMNS = [Column("fault", lambda r: {"kill": "SIGKILL rank on the last host", "link": "link of a host down"}[r["fault"]], "l"),
           Column("--parallel", lambda r: str(r["parallel"])),
           Column("answers equal", lambda r: f"{r['same']}/{r['requests']}" if "same" in r else f"FAILED: {r['error']}"),
           Column("longest silence of the stream", lambda r: fmt(r.get("longest_silence_s"), ".1f", " s")),
           Column("without pipeline", lambda r: fmt(r.get("without_pipeline_s"), ".1f", " s")),
           Column("restarts", lambda r: fmt(r.get("restarts"), ".0f")),
           Column("old job left", lambda r: "none" if not r.get("old_job_left") else str(len(r["old_job_left"])))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="'' for none")
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--cpus", default="0.5")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("-n", type=int, default=64, help="tokens per answer")
    ap.add_argument("--parallel", default="2,1")
    ap.add_argument("--faults", default="kill,link")
    ap.add_argument("--rank-timeout", type=float, default=20)
    ap.add_argument("--prefix", default="pi-sr")
    ap.add_argument("--subnet", default="10.216.0.0/24")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args(argv)
    out = Path("build/serve_recovery")
    out.mkdir(parents=True, exist_ok=True)

    def run() -> int:
        rows = []
        with emulated_cluster(args.prefix, args.subnet, args.hosts, args.rate, cpus=args.cpus) as c:
            for fault in args.faults.split(","):
                for parallel in map(int, args.parallel.split(",")):
                    rows.append(one_row(c, args, fault, parallel, out))
        notes = [f"{args.hosts} emulated hosts x {args.cpus} CPU, {args.rate}; {args.model}"
                 + (f" with draft {args.draft}" if args.draft else "") + f"; {args.n} tokens per answer; "
                 f"--rank-timeout {args.rank_timeout:g} s (a silent link is noticed after it)."]
        publish(render(COLUMNS, rows), {"config": vars(args), "rows": rows}, args.json, args.markdown, notes)
        bad = [r for r in rows if r.get("same") != r.get("requests") or r.get("old_job_left")]
        if bad:
            log(f"Error: {len(bad)} row(s) failed: " + "; ".join(f"{r['fault']} --parallel {r['parallel']}" for r in bad))
            return 1
        return 0

    return main_guard(run)


if __name__ == "__main__":
    raise SystemExit(main())
