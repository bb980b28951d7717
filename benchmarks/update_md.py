#!/usr/bin/env python3
"""Write the `make bench` results into BENCHMARKS.md, between <!-- bench:begin --> and <!-- bench:end -->.

Reads the `pipeinfer bench --json` output and the llama.cpp reference (benchmarks/llamacpp.py
--json), and writes: the exact commands, the machine, the per-mode table, the ratio of every mode
to llama.cpp's own decoding at the same total threads, the per-prompt figures, and the plot.
The rest of BENCHMARKS.md is left as it is; the markers are appended if missing.

    python -m benchmarks.update_md build/bench.json --baseline build/bench_llamacpp.json \\
        --plot docs/bench.png --out BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks.figures import paired_ratio, per_prompt

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def mode_ratio(records: list[dict], mode: str, base: dict[str, float], key: str) -> float | None:
    """Geometric mean over prompts of median(mode key) / llama.cpp median(key)."""
    return paired_ratio(per_prompt((r for r in records if r["mode"] == mode and not r["warmup"]), key), base)


def baseline_medians(doc: dict, key: str) -> dict[str, float]:
    return per_prompt(doc["records"], key)


def load_note(load_base: list | None, load_bench: list | None, threads: int) -> str:
    """The two runs are not interleaved: say how busy the machine was at the end of each."""
    if not load_base or not load_bench:
        return ""
    note = (f" Load average (1 min) at the end of the llama.cpp run: {load_base[0]}; at the end of the pipeinfer run: "
            f"{load_bench[0]}.")
    if max(load_base[0], load_bench[0]) > threads + 0.5:
        note += (f" **Other jobs shared the cores** (load above the {threads} threads measured here), and the two runs "
                 "did not see the same load: read the ratios with care.")
    return note


def section(bench: dict, base: dict | None, plot: Path | None, out_dir: Path) -> str:
    from pipeinfer_cli.bench.report import markdown_table

    h, summary = bench["header"], bench["summary"]
    modes = h["config"]["modes"]
    host, v, topo = h["host"], h["versions"], h["topology"]
    lines = [BEGIN, "",
             f"## `make bench` — {h['models']['target']['name']}"
             + (f" + {h['models']['draft']['name']}" if h["models"].get("draft") else "") + f" ({h['created_utc']})", "",
             "Written by `benchmarks/update_md.py` from the JSON of the run; do not edit by hand.", "",
             "**Commands** (in this order, in one `make bench`):", "", "```"]
    if base:
        lines.append(base["command"])
    lines += [h["command"], "```", "",
              f"**Machine:** {host['cpu_model']}, {host['cores']} cores ({host['cores_usable']} usable), "
              f"{host['mem_total_gib']} GiB, {host['os']}; SIMD: {', '.join(host['cpu_flags'])}"
              + (f"; load average {' / '.join(map(str, host['load_avg']))} (1/5/15 min) at the end of the run"
                 if host.get("load_avg") else "") + ".  ",
              f"**Versions:** pipeinfer {v['pipeinfer']}, llama-cpp-python {v['llama_cpp_python']}, ggml {v['ggml']}, "
              f"mpi4py {v['mpi4py']}, {v['mpi_library']}.  ",
              f"**Topology:** {topo['world_size']} ranks, layer split {topo['layer_split']}, threads "
              + ", ".join(f"rank {r['rank']} ({r['role']}, layers {r['layers'][0]}–{r['layers'][1] - 1}): {r['threads']}"
                          if r.get("layers") else f"rank {r['rank']} ({r['role']}): {r['threads']}" for r in topo["ranks"])
              + f" — {topo['threads_total']} threads in total.  ",
              f"**Workload:** {h['config']['prompts']['count']} prompts "
              f"({'the shipped default set' if h['config']['prompts']['default'] else h['config']['prompts']['path']}), "
              f"greedy, -n {h['config']['n_predict']}, {h['config']['repeat']} measured repeat(s) after "
              f"{h['config']['warmup']} warmup round(s), modes interleaved.", ""]
    if not bench["tokens_identical"]:
        bad = sorted({m["prompt_id"] for m in bench["token_mismatches"]})
        lines += [f"> **Warning: the modes generated different tokens on {len(bad)} prompt(s): {', '.join(bad)}.** "
                  "Greedy speculation must be lossless; `token_mismatches` in the run's JSON gives the first "
                  "differing token of each.", ""]
    else:
        lines += ["Every mode generated exactly the same tokens on every prompt.", ""]
    lines += [markdown_table(summary, modes), "",
              "tok/s is end to end (prompt processing included: n_gen / (t_last_token − t_start)); decode tok/s excludes "
              "the first token. Speedups are geometric means over prompts of the ratio of per-prompt medians.", ""]
    if base:
        b_tok, b_dec = baseline_medians(base, "tok_per_s"), baseline_medians(base, "decode_tok_per_s")
        match = None
        if "iterative" in modes:
            ref = {r["prompt_id"]: r["tokens"] for r in bench["records"] if r["mode"] == "iterative"}
            match = all(ref.get(r["prompt_id"]) == r["tokens"] for r in base["records"] if r["prompt_id"] in ref)
        lines += [f"### Against llama.cpp's own decoding ({base['threads']} threads, one process)", "",
                  f"llama-cpp-python {base['versions']['llama_cpp_python']}, greedy, same prompts and -n, measured right "
                  f"before: median {base['median']['tok_per_s']:.2f} tok/s end to end, "
                  f"{base['median']['decode_tok_per_s']:.2f} tok/s decode."
                  + load_note((base.get("host") or {}).get("load_avg"), host.get("load_avg"), topo["threads_total"])
                  + ("" if base["threads"] == topo["threads_total"] else
                     f" **Note: the pipeinfer run used {topo['threads_total']} threads in total.**")
                  + ("" if match is None else (" Its greedy tokens are identical to pipeinfer's `iterative` mode on every prompt." if match else
                                              " **Its greedy tokens differ from pipeinfer's `iterative` mode on some prompt.**")),
                  "", "| mode | tok/s ÷ llama.cpp | decode tok/s ÷ llama.cpp |", "|---|---:|---:|"]
        for m in modes:
            r1, r2 = mode_ratio(bench["records"], m, b_tok, "tok_per_s"), mode_ratio(bench["records"], m, b_dec, "decode_tok_per_s")
            lines.append(f"| `{m}` | {'–' if r1 is None else f'{r1:.2f}×'} | {'–' if r2 is None else f'{r2:.2f}×'} |")
        lines.append("")
    lines += ["### Per prompt (median tok/s)", "",
              "| prompt | n_gen | " + " | ".join(f"`{m}`" for m in modes) + (" | llama.cpp |" if base else " |"),
              "|---|---:|" + "---:|" * (len(modes) + (1 if base else 0))]
    meds: dict[tuple[str, str], list[float]] = {}
    n_gen: dict[str, int] = {}
    for r in bench["records"]:
        if not r["warmup"]:
            meds.setdefault((r["mode"], r["prompt_id"]), []).append(r["tok_per_s"] or 0.0)
            n_gen.setdefault(r["prompt_id"], r["n_gen"])
    b_tok = baseline_medians(base, "tok_per_s") if base else {}
    for pid in h["config"]["prompts"]["ids"]:
        cells = [f"{statistics.median(meds[(m, pid)]):.2f}" if (m, pid) in meds else "–" for m in modes]
        if base:
            cells.append(f"{b_tok[pid]:.2f}" if pid in b_tok else "–")
        lines.append(f"| {pid} | {n_gen.get(pid, '–')} | " + " | ".join(cells) + " |")
    lines.append("")
    if plot:
        rel = Path(plot).resolve().relative_to(out_dir.resolve()) if Path(plot).resolve().is_relative_to(out_dir.resolve()) else plot
        lines += [f"![tokens/s per mode and per-rank timelines]({rel})", "",
                  "Top: tokens/s per mode (median, whiskers min–max). Below: what each rank computes over time for "
                  "one prompt in each mode (grey prefill, blue single-token decode, orange speculative verification, "
                  "green drafting, red cancelled).", ""]
    lines.append(END)
    return "\n".join(lines) + "\n"


def replace_section(text: str, new: str) -> str:
    if BEGIN in text and END in text:
        a, b = text.index(BEGIN), text.index(END) + len(END)
        return text[:a] + new.rstrip("\n") + text[b:]
    return text.rstrip("\n") + "\n\n" + new


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_json", type=Path)
    ap.add_argument("--baseline", type=Path, help="benchmarks/llamacpp.py --json output")
    ap.add_argument("--plot", type=Path, help="the --plot PNG, linked relative to the output file")
    ap.add_argument("--out", type=Path, default=Path("BENCHMARKS.md"))
    args = ap.parse_args()
    bench = json.loads(args.bench_json.read_text())
    base = json.loads(args.baseline.read_text()) if args.baseline else None
    text = args.out.read_text() if args.out.exists() else "# Benchmarks\n"
    args.out.write_text(replace_section(text, section(bench, base, args.plot, args.out.parent)))
    print(f"updated {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
