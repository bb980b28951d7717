#!/usr/bin/env python3
"""Benchmark the native layer engine against llama-cpp-python on the same GGUF, side by side.

For each model and thread count it measures, alternating the engines eval by eval so that
background load hits all alike, and reporting medians:
- decode tokens/s: greedy single-token evals after a 64-token prompt, all layers in one process;
- the time of one eval of a batch of 1, 2, 4 and 8 tokens (--batch-sizes; all rows' logits, as a
  speculative verification needs, or with --batch-logits last the last row's, as a prompt chunk
  needs), rolled back after each try;
and, in a child process, the peak RSS of a half-model layer range (first and second half).

Wall times are what a user sees; with one thread, the process CPU time of an eval ("cpu"
columns) is the compute cost without the noise of other jobs on a shared machine (with two
threads it also counts OpenMP's spin-waiting, so compare wall times there).

Prints a table on stdout and writes JSON with every sample (--json). Not a test: nothing asserts.

    python -m benchmarks.native --model qwen2.5-coder-1.5b-instruct --threads 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.report import markdown_table, publish
from benchmarks.runner import module, run_json, target_model

PROMPT_TEXT = (b"def quicksort(items):\n    \"\"\"Sort a list with quicksort and return a new list.\"\"\"\n"
               b"    if len(items) <= 1:\n        return items\n")
N_PROMPT = 64


def prompt_tokens(path: Path) -> list[int]:
    import llama_cpp

    from pipeinfer_cli.native import ggml_cpu

    ggml_cpu()  # llama.cpp computes with the CPU backend registered; a per-variant ggml has none yet
    toks = llama_cpp.Llama(str(path), vocab_only=True, verbose=False).tokenize(PROMPT_TEXT, add_bos=False)
    return batch_tokens(toks, N_PROMPT)


# Rows of the tables: the engines, then the optional flash-attention and batch-invariant variants.
ENGINES = ("native", "llama.cpp", "native-fa", "native-inv")


class NativeRunner:
    """All layers of the model in one LayerEngine."""

    def __init__(self, path: Path, n_threads: int, n_ctx: int, flash_attn: bool = False, invariant: bool = False):
        from pipeinfer_cli.native import LayerEngine

        self.name = "native-fa" if flash_attn else "native-inv" if invariant else "native"
        self.invariant = invariant
        probe = LayerEngine(path, 0, 1, n_ctx=16)
        self.eng = LayerEngine(path, 0, probe.n_layer, n_ctx=n_ctx, n_threads=n_threads, flash_attn=flash_attn)
        del probe

    def reset(self) -> None:
        self.eng.kv_clear()

    def eval(self, tokens: list[int], pos0: int, all_rows: bool) -> np.ndarray:
        n = len(tokens)
        return self.eng.eval(tokens=np.array(tokens, np.int32), pos=np.arange(pos0, pos0 + n, dtype=np.int32),
                             seq_ids=[[0]] * n, output=np.ones(n, bool) if all_rows else None,
                             batch_invariant=self.invariant)

    def rollback(self, pos: int) -> None:
        self.eng.seq_rm(0, pos, -1)


class LlamaCppRunner:
    """llama_cpp.Llama with logits_all=True, so that every eval returns logits like the native one."""

    name = "llama.cpp"

    def __init__(self, path: Path, n_threads: int, n_ctx: int, logits_all: bool = True):
        import llama_cpp

        from pipeinfer_cli.native import ggml_cpu

        ggml_cpu()
        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                                   logits_all=logits_all, verbose=False)

    def reset(self) -> None:
        self.llm.reset()
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.llm.ctx), True)

    def eval(self, tokens: list[int], pos0: int, all_rows: bool) -> np.ndarray:
        assert self.llm.n_tokens == pos0
        self.llm.eval(tokens)
        rows = slice(pos0, pos0 + len(tokens)) if all_rows else slice(pos0 + len(tokens) - 1, pos0 + len(tokens))
        return self.llm.scores[rows]

    def rollback(self, pos: int) -> None:
        self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.llm.ctx), 0, pos, -1)
        self.llm.n_tokens = pos


def decode_interleaved(runners, prompt: list[int], n_decode: int) -> tuple[dict, dict]:
    """Greedy decode on every runner, one step each in turn, so that background load hits all
    engines alike. Returns per-step wall and CPU times (ms) and the generated tokens per runner."""
    cur, toks = {}, {r.name: [] for r in runners}
    times = {r.name: [] for r in runners}
    cpu = {r.name: [] for r in runners}  # process CPU time per step: immune to preemption by other jobs
    for r in runners:
        r.reset()
        cur[r.name] = int(r.eval(prompt, 0, all_rows=False)[-1].argmax())
    for i in range(n_decode):
        for r in runners:
            toks[r.name].append(cur[r.name])
            c0, t0 = time.process_time(), time.perf_counter()
            logits = r.eval([cur[r.name]], len(prompt) + i, all_rows=False)
            times[r.name].append((time.perf_counter() - t0) * 1e3)
            cpu[r.name].append((time.process_time() - c0) * 1e3)
            cur[r.name] = int(logits[-1].argmax())
    return times, cpu, toks


def batch_tokens(prompt: list[int], b: int) -> list[int]:
    """b tokens for a timed batch: the prompt's, repeated when b is longer than the prompt (a batch
    of b rows must compute b rows, whatever the prompt's length)."""
    return (prompt * (b // len(prompt) + 1))[:b]


def batches_interleaved(runners, prompt: list[int], batch_sizes: list[int], n_rep: int, all_rows: bool = True) -> dict:
    """Time one eval of a batch of b tokens (every row's logits, or the last row's) after the prompt, rolled back
    after each try; engines alternate try by try."""
    times = {r.name: {b: [] for b in batch_sizes} for r in runners}
    cpu = {r.name: {b: [] for b in batch_sizes} for r in runners}
    for r in runners:
        r.reset()
        r.eval(prompt, 0, all_rows=False)
    for b in batch_sizes:
        batch = batch_tokens(prompt, b)
        for _ in range(n_rep):
            for r in runners:
                c0, t0 = time.process_time(), time.perf_counter()
                r.eval(batch, len(prompt), all_rows=all_rows)
                times[r.name][b].append((time.perf_counter() - t0) * 1e3)
                cpu[r.name][b].append((time.process_time() - c0) * 1e3)
                r.rollback(len(prompt))
    return times, cpu


def bench_model(path: Path, threads: list[int], n_decode: int, batch_sizes: list[int],
                n_rep: int, n_ctx: int, flash_attn: bool, invariant: bool = False, all_rows: bool = True) -> dict:
    prompt = prompt_tokens(path)
    res: dict = {"model": path.name, "threads": {}}
    for nt in threads:
        runners = [NativeRunner(path, nt, n_ctx), LlamaCppRunner(path, nt, n_ctx, logits_all=all_rows)]
        if flash_attn:
            runners.append(NativeRunner(path, nt, n_ctx, flash_attn=True))
        if invariant:
            runners.append(NativeRunner(path, nt, n_ctx, invariant=True))
        decode_interleaved(runners, prompt, 4)  # warm-up: page in weights, size the graph buffers
        step_ms, step_cpu_ms, tokens = decode_interleaved(runners, prompt, n_decode)
        batch_ms, batch_cpu_ms = batches_interleaved(runners, prompt, batch_sizes, n_rep, all_rows)
        # Medians of interleaved single evals: robust to the spikes of a shared machine.
        summary: dict = {}
        for r in runners:
            summary[r.name] = {
                "decode_tok_s": 1e3 / statistics.median(step_ms[r.name]),
                # with one thread, CPU time per token is the compute cost without the machine's noise
                "decode_cpu_ms": statistics.median(step_cpu_ms[r.name]),
                "batch_ms": {b: statistics.median(v) for b, v in batch_ms[r.name].items()},
                "batch_cpu_ms": {b: statistics.median(v) for b, v in batch_cpu_ms[r.name].items()},
            }
        summary["ratio_decode"] = summary["native"]["decode_tok_s"] / summary["llama.cpp"]["decode_tok_s"]
        summary["ratio_batch"] = {b: summary["llama.cpp"]["batch_ms"][b] / summary["native"]["batch_ms"][b]
                                  for b in batch_sizes}
        summary["same_greedy_tokens"] = tokens["native"] == tokens["llama.cpp"]
        if "native-fa" in tokens:
            summary["native_fa_same_greedy_tokens"] = tokens["native-fa"] == tokens["llama.cpp"]
        summary["ratio_decode_cpu"] = summary["llama.cpp"]["decode_cpu_ms"] / summary["native"]["decode_cpu_ms"]
        summary["ratio_batch_cpu"] = {b: summary["llama.cpp"]["batch_cpu_ms"][b] / summary["native"]["batch_cpu_ms"][b]
                                      for b in batch_sizes}
        summary["samples"] = {"decode_step_ms": step_ms, "decode_step_cpu_ms": step_cpu_ms, "batch_ms": batch_ms,
                              "batch_cpu_ms": batch_cpu_ms}
        res["threads"][nt] = summary
        del runners
    return res


def rss_child(path: str, begin: int, end: int, n_ctx: int) -> None:
    """Runs in a fresh process: load one range, eval a few tokens, report memory as JSON."""
    from pipeinfer_cli.native import LayerEngine

    def status_kb(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

    def vm_rss_kb() -> int:
        return status_kb("VmRSS")

    baseline = vm_rss_kb()
    eng = LayerEngine(path, begin, end, n_ctx=n_ctx)
    n = 8
    pos = np.arange(n, dtype=np.int32)
    if eng.is_first:
        eng.eval(tokens=np.ones(n, np.int32), pos=pos, seq_ids=[[0]] * n)
    else:
        eng.eval(embd=np.zeros((n, eng.n_embd), np.float32), pos=pos, seq_ids=[[0]] * n)
    # VmHWM, not ru_maxrss: the latter keeps the forking parent's peak across exec.
    print(json.dumps({"layers": [begin, end], "n_layer": eng.n_layer, "baseline_rss_kb": baseline,
                      "rss_kb": vm_rss_kb(), "peak_rss_kb": status_kb("VmHWM"),
                      "weight_bytes": eng.weight_bytes, "kv_bytes": eng.kv_bytes, "n_ctx": n_ctx}))


def measure_rss(path: Path, n_ctx: int) -> list[dict]:
    from pipeinfer_cli.native import LayerEngine

    n_layer = LayerEngine(path, 0, 1, n_ctx=16).n_layer
    half = n_layer // 2
    out = []
    for begin, end in ((0, half), (half, n_layer)):
        job = run_json(module("native", "--rss-child", path, begin, end, n_ctx))
        if not job.ok:
            raise SystemExit(f"Error: the RSS measurement of layers [{begin}, {end}) failed: {job.error}")
        out.append(job.doc)
    return out


def print_table(results: list[dict], batch_sizes: list[int]) -> None:
    print(f"{'model':42s} {'thr':>3s} {'engine':>9s} {'decode tok/s':>12s} {'cpu ms/tok':>10s} " +
          " ".join(f"{'b=' + str(b) + ' ms':>9s}" for b in batch_sizes) + "  " +
          " ".join(f"{'b=' + str(b) + ' cpu':>9s}" for b in batch_sizes))
    for res in results:
        for nt, s in res["threads"].items():
            for name in ENGINES:
                if name not in s:
                    continue
                row = s[name]
                print(f"{res['model']:42s} {nt:>3d} {name:>9s} {row['decode_tok_s']:12.2f} {row['decode_cpu_ms']:10.2f} " +
                      " ".join(f"{row['batch_ms'][b]:9.2f}" for b in batch_sizes) + "  " +
                      " ".join(f"{row['batch_cpu_ms'][b]:9.2f}" for b in batch_sizes))
            print(f"{'':42s} {nt:>3d} {'ratio':>9s} {s['ratio_decode']:12.3f} {s['ratio_decode_cpu']:10.3f} " +
                  " ".join(f"{s['ratio_batch'][b]:9.3f}" for b in batch_sizes) + "  " +
                  " ".join(f"{s['ratio_batch_cpu'][b]:9.3f}" for b in batch_sizes) +
                  f"   same greedy tokens: {s['same_greedy_tokens']}")
        for m in res.get("rss", []):
            print(f"{res['model']:42s} layers [{m['layers'][0]}, {m['layers'][1]}) of {m['n_layer']}: "
                  f"peak RSS {m['peak_rss_kb'] / 1024:.0f} MiB (before load {m['baseline_rss_kb'] / 1024:.0f} MiB); "
                  f"weights {m['weight_bytes'] / 2**20:.0f} MiB + KV {m['kv_bytes'] / 2**20:.0f} MiB (n_ctx {m['n_ctx']})")


def native_table(results: list[dict], batch_sizes: list[int]) -> str:
    """The table for BENCHMARKS.md: per model and thread count, both engines and the ratios."""
    rows = []
    for res in results:
        model = res["model"].replace(".gguf", "")
        for nt, s in res["threads"].items():
            for name in ENGINES:
                if name in s:
                    row = s[name]
                    rows.append([model, str(nt), name, f"{row['decode_tok_s']:.2f}", f"{row['decode_cpu_ms']:.2f}"]
                                + [f"{row['batch_ms'][b]:.1f} ({row['batch_cpu_ms'][b]:.1f})" for b in batch_sizes])
            rows.append([model, str(nt), "**native / llama.cpp**", f"**{s['ratio_decode']:.3f}**",
                         f"**{s['ratio_decode_cpu']:.3f}**"]
                        + [f"{s['ratio_batch'][b]:.3f} ({s['ratio_batch_cpu'][b]:.3f})" for b in batch_sizes])
    head = ["model", "threads", "engine", "decode tok/s", "CPU ms/token"] + [f"batch {b}: ms (CPU ms)" for b in batch_sizes]
    return markdown_table(head, rows, "l" * len(head))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rss-child":
        rss_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="registry name or GGUF path (repeatable)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--n-decode", type=int, default=64, help="greedy tokens decoded per engine")
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--batch-reps", type=int, default=9, help="tries per batch size per engine")
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--rss-n-ctx", type=int, default=4096, help="KV size of the half-model RSS measurement")
    ap.add_argument("--no-rss", action="store_true", help="skip the half-model peak RSS measurement")
    ap.add_argument("--flash-attn", action="store_true",
                    help="also time the native engine with flash_attn=True (row native-fa; ratios stay native/llama.cpp)")
    ap.add_argument("--invariant", action="store_true",
                    help="also time the native engine with batch_invariant=True, as pipeline decode and "
                         "verification runs use it (row native-inv)")
    ap.add_argument("--batch-logits", choices=("all", "last"), default="all",
                    help="logits of every row of a timed batch (as a verification needs; the default) or of "
                         "its last row only (as a prompt chunk needs)")
    ap.add_argument("--json", type=Path, help="write all results and samples here")
    ap.add_argument("--markdown", type=Path, nargs="?", metavar="FILE", help="the table is always printed; FILE: write the Markdown table (for BENCHMARKS.md) here too")
    ap.add_argument("--from-json", type=Path, help="do not measure: print the tables of an earlier --json run")
    args = ap.parse_args()

    if args.from_json:
        doc = json.loads(args.from_json.read_text())
        results = doc["results"]
        for res in results:  # JSON keys are strings
            res["threads"] = {int(k): v for k, v in res["threads"].items()}
            for s in res["threads"].values():
                for row in [s[n] for n in ENGINES if n in s] + [s]:
                    for key in ("batch_ms", "batch_cpu_ms", "ratio_batch", "ratio_batch_cpu"):
                        if key in row:
                            row[key] = {int(k): v for k, v in row[key].items()}
        sizes = sorted(next(iter(results[0]["threads"].values()))["ratio_batch"])
        print_table(results, sizes)
        publish(native_table(results, sizes), md_path=args.markdown)
        return

    models = args.model or ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]
    threads = [int(t) for t in args.threads.split(",")]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if max(batch_sizes) + N_PROMPT > args.n_ctx:
        sys.exit(f"Error: a batch of {max(batch_sizes)} after the prompt needs --n-ctx of at least "
                 f"{max(batch_sizes) + N_PROMPT}; raise --n-ctx or use smaller --batch-sizes")
    results = []
    for m in models:
        path = target_model(m)[1]
        print(f"benchmarking {path.name} ...", file=sys.stderr, flush=True)
        res = bench_model(path, threads, args.n_decode, batch_sizes, args.batch_reps, args.n_ctx, args.flash_attn,
                          args.invariant, all_rows=args.batch_logits == "all")
        if not args.no_rss:
            res["rss"] = measure_rss(path, args.rss_n_ctx)
        results.append(res)

    from pipeinfer_cli import _native

    doc = {"ggml_version": _native.ggml_version(), "arch": platform.processor() or platform.machine(),
           "cpu_count": os.cpu_count(), "loadavg_end": os.getloadavg(), "results": results,
           "settings": vars(args) | {"json": str(args.json) if args.json else None}}
    print_table(results, batch_sizes)
    publish(native_table(results, batch_sizes), doc, args.json, args.markdown)


if __name__ == "__main__":
    main()
