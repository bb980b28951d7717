#!/usr/bin/env python3
"""llama.cpp's RPC backend on the emulated cluster's hosts, against pipeinfer on the same hosts.

One `rpc-server` per host 1..N-1 (bound to that host's own address, 1 thread), the llama.cpp client
on host 0 (`llama-completion`, or `llama-speculative` with --draft) with `--rpc h1:port,h2:port,...`,
1 thread, greedy, on pipeinfer's benchmark prompts with the model's chat template applied exactly as
`pipeinfer generate --chat` applies it. Reported per prompt: decode tok/s, TTFT (llama.cpp's prompt
eval time), the generated text, the bytes through each host's link, and whether the text equals
pipeinfer's for the same prompt (run here with --pipeinfer, or read from --compare FILE).

How llama.cpp splits the model: the RPC servers are devices like GPUs; `-ngl K` puts the last K-1
layers and the output layer on them (in `--tensor-split` proportions, in --rpc order), and the
layers before stay on the client's own CPU. So host 0 computes the first layers itself, as
pipeinfer's head does, and needs no rpc-server of its own. By default the layers are split as
pipeinfer split them (its JSON's `ranks` when --pipeinfer or --compare gives one), else evenly;
--layers 14,14 sets them (host 0 first).

Every process on a host is started through the cluster's launcher (benchmarks/emulated.py on_host), so that it
lands in the host's network namespace, hostname and, with `up --cpus`, its cgroups. The cluster must
be up: `scripts/emulate-cluster.sh up 2 --rate 1gbit`. Every process this script starts is ended
on exit, on an error and on Ctrl-C/SIGTERM/SIGHUP.

    make llama-rpc                                   # build/llama-rpc/{rpc-server,llama-completion,llama-speculative}
    scripts/emulate-cluster.sh up 2 --rate 1gbit
    .venv/bin/python -m benchmarks.rpc qwen2.5-coder-1.5b-instruct --limit 2 -n 32 --pipeinfer --json build/rpc.json
    .venv/bin/python -m benchmarks.rpc qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --limit 2
    scripts/emulate-cluster.sh down
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.emulated import Cluster, Failure, main_guard, on_host
from benchmarks.figures import first_difference
from benchmarks.report import Column, fmt, publish, render
from benchmarks.runner import ROOT, end_group, log, pipeinfer, run_json, shown
from cluster.hosts import DEFAULT_PREFIX

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
DEFAULT_PORT = 50052  # rpc-server's own default


# -- processes on the hosts ---------------------------------------------------------------------

class Procs:
    """Every process this benchmark starts beside the jobs (the rpc-servers, the llama.cpp client),
    each in a session of its own: ended on exit (runner.end_group), and any process left in the
    cluster's namespaces whose session is one of ours is killed too."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.started: list[subprocess.Popen] = []

    def start(self, cmd: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(cmd, start_new_session=True, **kw)
        self.started.append(p)
        return p

    def run(self, cmd: list[str], timeout: float, **kw) -> tuple[int, str, str]:
        """cmd to its end (stdout, stderr captured); killed with its group on timeout or Ctrl-C."""
        p = self.start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            end_group(p, signal.SIGTERM, 5.0)
            raise Failure(f"`{shown(cmd)[:200]}` did not finish in {timeout:.0f} s") from None
        finally:
            end_group(p, signal.SIGTERM, 5.0)
        return p.returncode, out.decode("utf-8", errors="replace"), err.decode("utf-8", errors="replace")

    def end_all(self) -> None:
        for p in self.started:
            end_group(p, signal.SIGTERM, 5.0)
        sessions = {p.pid for p in self.started}
        for pid in self.cluster.pids():  # belt and braces: ours only (our sessions)
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[4]) in sessions:
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError, IndexError):
                pass


def listening(cluster: Cluster, k: int, port: int) -> bool:
    """Whether something listens on host k's address and port (read inside the host's namespace)."""
    r = subprocess.run(["ip", "netns", "exec", cluster.host(k), "ss", "-ltnH", f"sport = :{port}"],
                       capture_output=True, text=True)
    return any(cluster.addr(k) in line for line in r.stdout.splitlines())


def start_rpc_servers(args, cluster: Cluster, procs: Procs, log_dir: Path) -> list[dict]:
    """One rpc-server per host 1..N-1, bound to the host's own address (its default, 127.0.0.1,
    would be unreachable from host 0; 0.0.0.0 would be every interface). Waits until each listens."""
    servers = []
    for k in range(1, cluster.n_hosts):
        argv = [str(args.bin_dir / "rpc-server"), "-H", cluster.addr(k), "-p", str(args.port), "-t", str(args.threads)]
        if args.rpc_cache:
            # -c: tensors above a size threshold are stored under $LLAMA_CACHE/rpc keyed by their hash;
            # a client that finds the hash there sends the hash instead of the bytes (loads faster).
            argv = ["env", f"LLAMA_CACHE={args.rpc_cache / cluster.host(k)}", *argv, "-c"]
        log = open(log_dir / f"rpc-server-{cluster.host(k)}.log", "wb")
        p = procs.start(on_host(cluster, k, argv), stdout=log, stderr=subprocess.STDOUT)
        servers.append({"host": cluster.host(k), "addr": cluster.addr(k), "port": args.port, "command": argv,
                        "log": log.name, "proc": p})
    deadline = time.monotonic() + 30
    for s, k in zip(servers, range(1, cluster.n_hosts)):
        while not listening(cluster, k, args.port):
            if s["proc"].poll() is not None or time.monotonic() > deadline:
                raise Failure(f"rpc-server on {s['host']} did not start: {Path(s['log']).read_text(errors='replace')[-600:]}")
            time.sleep(0.1)
    return servers


# -- prompts, as pipeinfer formats them -----------------------------------------------------------

def prompt_texts(model_path: Path, prompts) -> list[dict]:
    """Each prompt as the text llama.cpp should tokenize to get pipeinfer's prompt tokens: a chat
    prompt through the model's chat template (pipeinfer's own rendering), a raw one as it is."""
    from pipeinfer_cli.runtime.tokenizer import Tokenizer, _render_chat

    tok = Tokenizer(model_path)
    out = []
    try:
        for p in prompts:
            if p.kind == "chat":
                messages = [dict(m) for m in p.messages]
                template = tok.metadata.get("tokenizer.chat_template")
                eos = tok.llm._model.token_get_text(tok.llm.token_eos()) if tok.llm.token_eos() >= 0 else ""
                bos = tok.llm._model.token_get_text(tok.llm.token_bos()) if tok.llm.token_bos() >= 0 else ""
                text = _render_chat(model_path, template, messages, eos, bos)
                ids = tok.chat_messages(messages)
                # llama.cpp adds BOS itself when the vocabulary asks for it: drop the template's
                if tok.add_bos and bos and text.startswith(bos):
                    text = text[len(bos):]
            else:
                messages, text = None, p.prompt
                ids = tok.encode(text)
            assert tok.encode(text) == ids, f"{p.id}: the rendered text does not tokenize to pipeinfer's prompt"
            out.append({"id": p.id, "kind": p.kind, "messages": messages, "raw": p.prompt, "text": text,
                        "prompt_tokens": ids})
        return out
    finally:
        tok.close()


def first_n_tokens(model_path: Path, text: str, n: int) -> str:
    """text cut after its first n tokens (llama-speculative may generate past -n)."""
    from pipeinfer_cli.runtime.tokenizer import Tokenizer

    tok = Tokenizer(model_path)
    try:
        ids = tok.encode_bytes(text.encode(), add_bos=False)
        return b"".join(tok.piece(t) for t in ids[:n]).decode("utf-8", errors="replace")
    finally:
        tok.close()


# -- llama.cpp's output -------------------------------------------------------------------------

_PERF = re.compile(r"(prompt eval|eval|load|total) time\s*=\s*([\d.]+) ms(?:\s*/\s*(\d+) (tokens|runs))?")


def parse_perf(stderr: str, section: str | None = None) -> dict:
    """llama_perf_context_print's lines: prompt eval / eval / load / total time, their counts.
    With section ('target:'), only the lines after that header (llama-speculative prints the
    draft's first)."""
    if section and section in stderr:
        stderr = stderr.split(section, 1)[1]
    out: dict = {}
    for m in _PERF.finditer(stderr):
        key = m.group(1).replace(" ", "_")
        if f"{key}_ms" in out:  # the first line of each kind counts
            continue
        out[f"{key}_ms"] = float(m.group(2))
        if m.group(3):
            out[f"{key}_n"] = int(m.group(3))
    return out


def completion_text(stdout: str) -> tuple[str, bool]:
    """llama-completion's stdout with --no-display-prompt: the generated text, then " [end of
    text]\\n" at an end-of-generation token, then "\\n\\n" (and its perf print goes to stderr)."""
    text = stdout[:-2] if stdout.endswith("\n\n") else stdout
    eog = text.endswith(" [end of text]\n")
    if eog:
        text = text[: -len(" [end of text]\n")]
    return text, eog


def speculative_text(stdout: str, prompt: str) -> tuple[str, bool]:
    """llama-speculative's stdout: "\\n\\n", the prompt's pieces (special tokens spelled out), the
    generated pieces (an end-of-generation token spelled out too), "\\n\\n"."""
    body = stdout[2:] if stdout.startswith("\n\n") else stdout
    if not body.startswith(prompt):
        raise Failure("llama-speculative did not echo the prompt as rendered; cannot cut it from its output")
    text = body[len(prompt):]
    text = text[:-2] if text.endswith("\n\n") else text
    eog = False
    for tok in ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>"):
        if text.endswith(tok):
            text, eog = text[: -len(tok)], True
    return text, eog


# -- the layer split ----------------------------------------------------------------------------

def layer_placement(n_layer: int, counts: list[int]) -> tuple[int, list[int]]:
    """llama.cpp's -ngl and --tensor-split for counts[k] layers on host k (host 0: the client's own
    CPU). llama.cpp offloads the last ngl-1 layers and the output layer: layer il goes to the first
    RPC device j whose cumulative share exceeds (il - i_gpu_start) / ngl, so weights equal to the
    layer counts, plus one for the output on the last, reproduce the counts exactly."""
    if sum(counts) != n_layer or any(c < 0 for c in counts) or len(counts) < 2:
        raise Failure(f"--layers {counts}: one count per host (host 0 first) adding up to the model's {n_layer} layers")
    ngl = n_layer - counts[0] + 1
    ts = counts[1:]
    ts[-1] += 1
    return ngl, ts


def even_counts(n_layer: int, n_hosts: int) -> list[int]:
    base, extra = divmod(n_layer, n_hosts)
    return [base + (1 if k < extra else 0) for k in range(n_hosts)]


def counts_from_pipeinfer(result: dict) -> list[int] | None:
    """Layers per target stage (in rank order) from a pipeinfer JSON object's `ranks`."""
    if result.get("layers_per_host"):  # as this script records it
        return list(result["layers_per_host"])
    ranks = [r for r in result.get("ranks") or [] if r.get("role") in ("head", "stage") and r.get("layers")]
    if not ranks:
        return None
    return [int(r["layers"][1]) - int(r["layers"][0]) for r in sorted(ranks, key=lambda r: r.get("rank", 0))]


# -- pipeinfer on the same hosts ----------------------------------------------------------------

def run_pipeinfer(args, cluster: Cluster, p: dict, tmp: Path) -> dict:
    """`pipeinfer generate --ranks N --threads 1` on the hosts (the environment of
    `emulate-cluster.sh exec`), iterative unless --pipeinfer-mode says otherwise, --json."""
    cmd = pipeinfer("generate", args.model, "--ranks", cluster.n_hosts, "--threads", args.threads, "-M", args.pipeinfer_mode,
                    "--temp", 0, "-n", args.n_predict, "--json", "--no-pull")
    if args.pipeinfer_mode != "iterative" and args.draft:
        cmd += ["--draft", args.draft, "--n-draft", str(args.draft_max)]
    if args.counts:
        cmd += ["--layer-split", ",".join(str(c / sum(args.counts)) for c in args.counts)]
    if p["kind"] == "chat":
        f = tmp / f"{p['id']}.messages.json"
        f.write_text(json.dumps(p["messages"]))
        cmd += ["--messages", str(f)]
    else:
        cmd += ["-p", p["raw"]]
    log(f"+ {shown(cmd)}")
    job = run_json(cmd, env=cluster.env(), timeout=args.timeout)
    if not job.ok:
        raise Failure(f"pipeinfer generate failed ({job.returncode}): {job.error}")
    return job.doc


def load_compare(path: Path) -> list[dict]:
    """pipeinfer results from a file: `generate --json` (one object, or one per line) or
    `bench --json` (its `records`, warmups left out)."""
    text = path.read_text()
    data = None
    try:
        data = json.loads(text)
        items = data.get("records", [data]) if isinstance(data, dict) else data
    except json.JSONDecodeError:
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(data, dict) and data.get("schema", "").startswith("pipeinfer-bench-rpc/"):
        # an earlier run of this script: the pipeinfer results it recorded
        return [{**r["pipeinfer"], "prompt_id": r["prompt_id"]} for r in items if r.get("pipeinfer")]
    return [r for r in items if isinstance(r, dict) and "text" in r and not r.get("warmup")]


def compare_for(compare: list[dict], prompt_id: str, n_prompts: int) -> dict | None:
    hits = [r for r in compare if r.get("prompt_id") == prompt_id]
    hits = [r for r in hits if r.get("mode") == "iterative"] or hits
    if hits:
        return hits[0]
    if len(compare) == 1 and n_prompts == 1:  # a lone `generate --json` names no prompt id
        return compare[0]
    return None


def first_diff(a: str, b: str) -> int | None:
    return None if a == b else first_difference(a, b)


# -- one prompt on llama.cpp ----------------------------------------------------------------------

def run_llamacpp(args, cluster: Cluster, procs: Procs, servers: list[dict], p: dict, ngl: int, ts: list[int]) -> dict:
    rpc = ",".join(f"{s['addr']}:{s['port']}" for s in servers)
    common = ["-m", str(args.model_path), "--rpc", rpc, "-ngl", str(ngl), "-ts", ",".join(map(str, ts)),
              "-t", str(args.threads), "-tb", str(args.threads), "--temp", "0", "--seed", "0", "-n", str(args.n_predict),
              "-c", str(args.ctx), "-fit", "off", "-fa", args.flash_attn, "--no-escape", "-p", p["text"]]
    if args.no_repack:
        common.append("--no-repack")
    if args.draft:
        # the draft on host 0's own CPU (-ngld 0), 1 thread, as pipeinfer's draft on the head
        argv = [str(args.bin_dir / "llama-speculative"), *common, "-md", str(args.draft_path), "-ngld", "0",
                "-td", str(args.threads), "-tbd", str(args.threads)]
        argv += ["--spec-draft-n-max", str(args.draft_max)]
    else:
        argv = [str(args.bin_dir / "llama-completion"), *common, "-no-cnv", "--no-display-prompt"]
    before = cluster.counters()
    t0 = time.monotonic()
    rc, out, err = procs.run(on_host(cluster, 0, argv), timeout=args.timeout)
    wall = time.monotonic() - t0
    after = cluster.counters()
    log = args.log_dir / f"{'llama-speculative' if args.draft else 'llama-completion'}-{p['id']}.log"
    log.write_text(err)
    if rc != 0:
        raise Failure(f"llama.cpp client failed ({rc}) on {p['id']}; its stderr ({log}) ends: {err[-800:]}")
    rec: dict = {"engine": "llama.cpp rpc" + (" speculative" if args.draft else ""), "command": argv,
                 "wall_s": round(wall, 3), "log": str(log)}
    if args.draft:
        text, eog = speculative_text(out, p["text"])
        perf = parse_perf(err, "target:")
        m_dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", err)
        m_enc = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", err)
        acc = {k: int(v) for k, v in re.findall(r"(n_draft|n_drafted|n_accept)\s*=\s*(\d+)", err)}
        n_gen = int(m_dec.group(1)) if m_dec else None
        rec.update(n_prompt=int(m_enc.group(1)) if m_enc else None, n_gen=n_gen,
                   ttft_ms=round(float(m_enc.group(2)) * 1000, 1) if m_enc else None,
                   decode_tok_per_s=round(n_gen / float(m_dec.group(2)), 3) if m_dec else None,
                   acceptance={"drafted": acc.get("n_drafted"), "accepted": acc.get("n_accept"),
                               "rate": round(acc["n_accept"] / acc["n_drafted"], 3) if acc.get("n_drafted") else None,
                               "n_draft": acc.get("n_draft")},
                   text_full=text, text=first_n_tokens(args.model_path, text, args.n_predict) if not eog else text)
    else:
        text, eog = completion_text(out)
        perf = parse_perf(err)
        n_eval = perf.get("eval_n")
        rec.update(n_prompt=perf.get("prompt_eval_n"), n_gen=(n_eval + 1) if n_eval is not None else None,
                   ttft_ms=perf.get("prompt_eval_ms"),
                   decode_tok_per_s=round(n_eval / perf["eval_ms"] * 1000, 3) if n_eval and perf.get("eval_ms") else None,
                   text=text)
    rec["finish_reason"] = "stop" if eog else "length"
    rec["perf"] = perf
    rec["prompt_tokens_match"] = rec["n_prompt"] == len(p["prompt_tokens"])
    rec["wire"] = {h: {"sent": after[h]["tx_by_host"] - before[h]["tx_by_host"],
                       "received": after[h]["rx_by_host"] - before[h]["rx_by_host"]} for h in after}
    head = cluster.host(0)
    rec["wire_head_received_per_token"] = round(rec["wire"][head]["received"] / rec["n_gen"]) if rec.get("n_gen") else None
    return rec


def summarize(records: list[dict]) -> dict:
    """Means over the prompts: llama.cpp's and (where known) pipeinfer's decode tok/s and TTFT."""
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return round(sum(xs) / len(xs), 3) if xs else None

    both = [r for r in records if r.get("pipeinfer")]
    out = {"n_prompts": len(records),
           "llamacpp_decode_tok_per_s": mean(r["decode_tok_per_s"] for r in records),
           "llamacpp_ttft_ms": mean(r["ttft_ms"] for r in records),
           # bytes into host 0 during a client run, per generated token: what the RPC hosts send back
           # (the last one the logits of every evaluated row); the weights go the other way
           "head_received_bytes_per_token": mean(r["wire_head_received_per_token"] for r in records)}
    if records and "acceptance" in records[0]:
        drafted = sum(r["acceptance"]["drafted"] or 0 for r in records)
        out["acceptance_rate"] = round(sum(r["acceptance"]["accepted"] or 0 for r in records) / drafted, 3) if drafted else None
    if both:
        out.update(pipeinfer_decode_tok_per_s=mean(r["pipeinfer"]["decode_tok_per_s"] for r in both),
                   pipeinfer_ttft_ms=mean((r["pipeinfer"]["ttft_s"] or 0) * 1000 for r in both),
                   texts_equal=sum(bool(r["text_matches_pipeinfer"]) for r in both), texts_compared=len(both))
        if out["pipeinfer_decode_tok_per_s"] and out["llamacpp_decode_tok_per_s"]:
            out["llamacpp_over_pipeinfer_decode"] = round(out["llamacpp_decode_tok_per_s"] / out["pipeinfer_decode_tok_per_s"], 3)
    return out


def summary_line(s: dict) -> str:
    line = (f"mean over {s['n_prompts']} prompts: llama.cpp rpc {s['llamacpp_decode_tok_per_s']} tok/s decode, "
            f"TTFT {s['llamacpp_ttft_ms']} ms, host 0 received {s['head_received_bytes_per_token'] or 0:.0f} B per token")
    if "acceptance_rate" in s:
        line += f", acceptance {s['acceptance_rate']}"
    if "texts_compared" in s:
        line += (f" | pipeinfer {s['pipeinfer_decode_tok_per_s']} tok/s decode, TTFT {s['pipeinfer_ttft_ms']} ms"
                 f" | llama.cpp/pipeinfer decode {s.get('llamacpp_over_pipeinfer_decode')}"
                 f" | texts equal {s['texts_equal']}/{s['texts_compared']}")
    return line


# -- main ---------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"registry name or .gguf (default {DEFAULT_MODEL})")
    ap.add_argument("--draft", help="draft model (registry name or .gguf): llama-speculative with -md, the draft on host 0's CPU")
    ap.add_argument("--draft-max", type=int, default=4,
                    help="draft tokens per step: llama-speculative's --spec-draft-n-max and pipeinfer's --n-draft "
                         "(default 4, pipeinfer's; llama-speculative's own is 3)")
    ap.add_argument("--prompts", default="default", help="pipeinfer prompt set: a shipped name or a JSONL file (default: default)")
    ap.add_argument("--limit", type=int, help="first N prompts")
    ap.add_argument("--only", help="only these prompt ids (comma-separated)")
    ap.add_argument("-n", "--n-predict", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1, help="threads of every process (client, rpc-server, pipeinfer rank)")
    ap.add_argument("--layers", help="layers per host, host 0 first (e.g. 14,14); default: as pipeinfer split them, else even")
    ap.add_argument("--flash-attn", "-fa", default="off", choices=["off", "on", "auto"],
                    help="llama.cpp's -fa (default off: the attention path of llama-cpp-python's default and pipeinfer's; "
                         "llama.cpp's own default, auto, turns it on for CPUs and changes greedy near-ties)")
    ap.add_argument("--no-repack", action="store_true",
                    help="host 0's weights in plain CPU buffers too (rpc-server never repacks: its layers use the plain "
                         "Q4_K kernels, host 0's the repacked ones unless this is given)")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"rpc-server port on every host (default {DEFAULT_PORT})")
    ap.add_argument("--rpc-cache", type=Path, nargs="?", const=ROOT / "build" / "llama-rpc" / "cache",
                    help="rpc-server -c: each host keeps received tensors in DIR/HOST (default build/llama-rpc/cache)")
    ap.add_argument("--bin-dir", type=Path, default=ROOT / "build" / "llama-rpc", help="where `make llama-rpc` put the binaries")
    ap.add_argument("--pipeinfer", action="store_true", help="also run `pipeinfer generate` on the same hosts and compare texts")
    ap.add_argument("--pipeinfer-mode", default="iterative", choices=["iterative", "speculative", "pipeinfer"])
    ap.add_argument("--compare", type=Path, help="pipeinfer JSON to compare with (generate --json, one per line, or bench --json)")
    ap.add_argument("--prefix", default=os.environ.get("PIPEINFER_EMU_PREFIX", DEFAULT_PREFIX), help="the cluster's --prefix")
    ap.add_argument("--timeout", type=float, default=600, help="seconds for one client run")
    ap.add_argument("--log-dir", type=Path, default=ROOT / "build" / "bench-rpc-logs")
    ap.add_argument("--json", type=Path, help="write the results here")
    return ap.parse_args(argv)


def measure(args, argv: list[str] | None, box: list) -> int:
    """Every prompt on llama.cpp over RPC (and pipeinfer with --pipeinfer); the table and JSON."""
    from pipeinfer_cli.bench.prompts import load_prompts, resolve_prompts
    from pipeinfer_cli.models.gguf_info import read_model_info
    from pipeinfer_cli.models.model_files import resolve_model
    from pipeinfer_cli.models.registry import load_registry

    if os.geteuid() != 0:
        raise Failure("the emulated cluster's hosts need root (namespaces)")
    cluster = Cluster(args.prefix)
    if not cluster.is_up:
        raise Failure(f"the emulated cluster {args.prefix} is not up: scripts/emulate-cluster.sh up N --rate RATE "
                      f"[--prefix {args.prefix}]")
    if cluster.n_hosts < 2:
        raise Failure("llama.cpp over RPC needs at least 2 hosts (the client on host 0, an rpc-server on each other)")
    for b in ("rpc-server", "llama-speculative" if args.draft else "llama-completion"):
        if not os.access(args.bin_dir / b, os.X_OK):
            raise Failure(f"{args.bin_dir / b} is missing: run `make llama-rpc`")
    reg = load_registry()
    args.model_path = resolve_model(args.model, reg).path
    args.draft_path = resolve_model(args.draft, reg).path if args.draft else None
    n_layer = read_model_info(args.model_path).n_layer
    args.counts = [int(x) for x in args.layers.split(",")] if args.layers else None
    if args.counts and len(args.counts) != cluster.n_hosts:
        raise Failure(f"--layers gives {len(args.counts)} counts for {cluster.n_hosts} hosts")
    chosen = load_prompts(resolve_prompts(args.prompts), None if args.only else args.limit)
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - {p.id for p in chosen}
        if unknown:
            raise Failure(f"--only: no prompt {', '.join(sorted(unknown))} in the set")
        chosen = [p for p in chosen if p.id in wanted][: args.limit]
    prompts = prompt_texts(args.model_path, chosen)
    compare = load_compare(args.compare) if args.compare else []
    args.log_dir.mkdir(parents=True, exist_ok=True)
    procs = Procs(cluster)
    box.append(procs)
    records = []
    with tempfile.TemporaryDirectory(prefix="bench-rpc-") as tmp:
        # Per prompt, pipeinfer (when --pipeinfer) then llama.cpp, so that both see the same load on
        # the machine. The first pipeinfer result decides llama.cpp's split (unless --layers); an
        # idle rpc-server waits in accept() and costs pipeinfer nothing.
        servers: list[dict] = []
        ngl, ts = 0, []
        for p in prompts:
            ref = run_pipeinfer(args, cluster, p, Path(tmp)) if args.pipeinfer else \
                compare_for(compare, p["id"], len(prompts))
            if not servers:
                if args.counts is None:
                    args.counts = next((c for c in map(counts_from_pipeinfer, [ref] if ref else compare)
                                        if c and len(c) == cluster.n_hosts), None) or even_counts(n_layer, cluster.n_hosts)
                ngl, ts = layer_placement(n_layer, list(args.counts))
                servers = start_rpc_servers(args, cluster, procs, args.log_dir)
                log(f"rpc-server on {', '.join(s['host'] + ' ' + s['addr'] + ':' + str(s['port']) for s in servers)}; "
                      f"layers per host {args.counts} (-ngl {ngl} -ts {','.join(map(str, ts))})")
            rec = {"prompt_id": p["id"], "kind": p["kind"], **run_llamacpp(args, cluster, procs, servers, p, ngl, ts)}
            if ref is not None:
                rec["pipeinfer"] = {k: ref.get(k) for k in ("mode", "text", "n_prompt", "n_gen", "ttft_s", "tok_per_s",
                                                            "decode_tok_per_s", "layer_split", "finish_reason")}
                rec["pipeinfer"]["layers_per_host"] = counts_from_pipeinfer(ref)
                rec["text_matches_pipeinfer"] = rec["text"] == ref["text"]
                rec["first_diff_char"] = first_diff(rec["text"], ref["text"])
                rec["prompt_tokens_match_pipeinfer"] = ref.get("n_prompt") in (None, len(p["prompt_tokens"]))
            records.append(rec)
            line = (f"{p['id']}: llama.cpp rpc {rec['decode_tok_per_s']} tok/s decode, TTFT {rec['ttft_ms']} ms, "
                    f"{rec['n_gen']} tokens")
            if args.draft:
                line += f", acceptance {rec['acceptance']['rate']}"
            if ref is not None:
                line += (f" | pipeinfer {ref.get('mode')} {ref.get('decode_tok_per_s') or 0:.2f} tok/s decode, TTFT "
                         f"{(ref.get('ttft_s') or 0) * 1000:.0f} ms | texts "
                         f"{'equal' if rec['text_matches_pipeinfer'] else 'DIFFER at char ' + str(rec['first_diff_char'])}")
            log(line)
            log("  " + json.dumps(rec["text"])[:300])
        summary = summarize(records)
        log(summary_line(summary))
        build_info = (args.bin_dir / "build-info.txt")
        result = {
            "schema": "pipeinfer-bench-rpc/1",
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": [sys.argv[0], *(argv if argv is not None else sys.argv[1:])],
            "cluster": {"prefix": cluster.prefix, "n_hosts": cluster.n_hosts, "rate": cluster.rate,
                        "cpus": getattr(cluster, "cpus", None) or None},
            "model": args.model, "model_path": str(args.model_path), "draft": args.draft,
            "draft_path": str(args.draft_path) if args.draft_path else None,
            "n_predict": args.n_predict, "threads": args.threads,
            "layers_per_host": args.counts, "ngl": ngl, "tensor_split": ts,
            "rpc_servers": [{k: v for k, v in s.items() if k != "proc"} for s in servers],
            "build_info": build_info.read_text() if build_info.exists() else None,
            "summary": summary,
            "records": records,
            "all_texts_match_pipeinfer": all(r.get("text_matches_pipeinfer") for r in records)
            if all("pipeinfer" in r for r in records) and records else None,
        }
    publish(render(COLUMNS, records), result, args.json, notes=[summary_line(summary)])
    return 0 if result["all_texts_match_pipeinfer"] in (None, True) else 2


COLUMNS = [Column("prompt", lambda r: r["prompt_id"], "l"), Column("tokens", lambda r: str(r.get("n_gen"))),
           Column("llama.cpp decode tok/s", lambda r: fmt(r.get("decode_tok_per_s"))),
           Column("llama.cpp TTFT ms", lambda r: fmt(r.get("ttft_ms"), ".0f")),
           Column("pipeinfer decode tok/s", lambda r: fmt((r.get("pipeinfer") or {}).get("decode_tok_per_s"))),
           Column("host 0 in, B/token", lambda r: fmt(r.get("wire_head_received_per_token"), ",.0f")),
           Column("texts", lambda r: "–" if "pipeinfer" not in r else "same" if r["text_matches_pipeinfer"]
                  else f"DIFFER at char {r['first_diff_char']}", "l")]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    box: list[Procs] = []
    try:
        return main_guard(lambda: measure(args, argv, box))
    finally:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        for procs in box:
            procs.end_all()


if __name__ == "__main__":
    sys.exit(main())
