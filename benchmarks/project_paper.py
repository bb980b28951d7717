"""Projection of the PipeInfer paper's setup with the validated planner (planner/project.py): a 70B
Q3_K_M Llama-family target on 7 stages and a 1.1B Q4_K_M draft on an eighth node, Gigabit
Ethernet, every figure stated below. Prints the tables BENCHMARKS.md quotes, writes a PNG of
speedup against node count and link rate, and the whole as JSON.

    python -m benchmarks.project_paper --png projection.png --json projection.json

With --from-profile PROFILE, the nodes are not stated but measured: every node takes the costs of
a rank of PROFILE (a `pipeinfer calibrate --draft ...` of emulated or real hosts), its layer costs
scaled by the 70B's layer bytes over the measured model's and the draft's by TinyLlama's bytes
over the measured draft's (planner/project.py scaled_profile); then `plan --search`'s search picks
pipeinfer's settings on that profile.

    python -m benchmarks.project_paper --from-profile build/cluster_h8_profile.json --json build/projection_scaled.json

Deterministic: the same figures give the same output. Takes a few minutes (hundreds of predictions).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from pipeinfer_cli.decode.session import DecodeOptions
from pipeinfer_cli.planner.plan import Replay, run_mode, speedup, summarize
from pipeinfer_cli.planner.predict import Topology
from pipeinfer_cli.planner.project import ClusterSpec, ModelSpec, NodeSpec, cluster_profile
from pipeinfer_cli.planner.replay import PromptTrace
from pipeinfer_cli.planner.layout import ranges_from_fractions

# -- the stated figures ----------------------------------------------------------------------------
# Llama-2-70B Q3_K_M: 33.2 GB; 80 layers of 8192 (about 855 M weights each, about 410 MB at Q3_K_M),
# an LM head of 32000 x 8192 at Q6_K (215 MB).
LLAMA_70B_Q3KM = ModelSpec("llama-70b-q3_k_m", 80, 8192, 32000, 410_000_000, 215_000_000, 855e6)
TINYLLAMA_Q4KM_BYTES = 669_000_000  # TinyLlama 1.1B Q4_K_M
# A server node: 16 cores, 25 GB/s effective memory bandwidth, 400 GFLOP/s on quantized matmuls,
# each further row of a batch costs 10 % of the first (memory-bound), 0.5 ms per run of Python and
# MPI (the order measured here, BENCHMARKS.md).
NODE = NodeSpec(mem_bandwidth=25e9, flops=400e9, row_cost=0.10, cores=16, memory=64 << 30, run_overhead_s=5e-4)
GBE = (117e6, 100e-6)  # Gigabit Ethernet: 117 MB/s of payload, 100 µs one way through MPI over TCP
LINKS = {"100 Mbit/s": (11.7e6, 150e-6), "1 Gbit/s": GBE, "10 Gbit/s": (1.17e9, 50e-6)}
PAPER_SPLIT = [0.1] + [0.15] * 6  # 0.1,0.15x6/1
PROMPT, GEN = 128, 128
OPTS = DecodeOptions(n_predict=GEN, n_draft=4, p_accept=0.5, max_inflight=4)
MODES = ("iterative", "speculative", "pipeinfer")


def spec(n_nodes=8, link=GBE, node=NODE, draft_bytes=TINYLLAMA_Q4KM_BYTES) -> ClusterSpec:
    return ClusterSpec(LLAMA_70B_Q3KM, node, n_nodes, link[0], link[1], draft_bytes, draft_on_rank=True)


def fractions(n_stages: int) -> list[float]:
    """The paper's shape for any stage count: the head a smaller share (it also launches and drafts)."""
    return PAPER_SPLIT if n_stages == 7 else ([0.1] + [0.9 / (n_stages - 1)] * (n_stages - 1) if n_stages > 1 else [1.0])


def predict_all(s: ClusterSpec, acceptance: float, opts: DecodeOptions = OPTS) -> dict:
    return predict_profile(cluster_profile(s), s.n_nodes, acceptance, opts)


def trace_of(acceptance: float) -> Replay:
    pt = PromptTrace("p", list(range(1000, 1000 + PROMPT)), [5000 + i for i in range(GEN)], "length")
    return Replay([pt], acceptance)


def topology(n_nodes: int, mode: str) -> Topology:
    n_stages = n_nodes - 1
    layers = ranges_from_fractions(fractions(n_stages), LLAMA_70B_Q3KM.n_layer)
    return Topology(list(range(n_stages)), layers, None if mode == "iterative" else n_stages)


def predict_profile(prof, n_nodes: int, acceptance: float, opts: DecodeOptions = OPTS) -> dict:
    return {mode: run_mode(prof, topology(n_nodes, mode), mode, trace_of(acceptance), opts, 4096) for mode in MODES}


def row(preds: dict) -> dict:
    r = {m: summarize(p).tok_per_s for m, p in preds.items()}
    r["pipeinfer_vs_iterative"] = speedup(preds["pipeinfer"], preds["iterative"])
    r["pipeinfer_vs_speculative"] = speedup(preds["pipeinfer"], preds["speculative"])
    r["speculative_vs_iterative"] = speedup(preds["speculative"], preds["iterative"])
    r["winner"] = max(MODES, key=lambda m: r[m] or 0)
    # After the first token (the paper's generation speed leaves the prompt out).
    r["decode_tok_per_s"] = {m: summarize(p).decode_tok_per_s for m, p in preds.items()}
    r["ttft_s"] = summarize(preds["iterative"]).ttft_s
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--png", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--from-profile", type=Path, metavar="PROFILE",
                    help="nodes like the ranks of this measured profile (with a model draft), scaled to the 70B")
    ap.add_argument("--measured-draft-bytes", type=int, metavar="BYTES",
                    help="the file size of PROFILE's draft model (default: found through the model registry)")
    args = ap.parse_args()
    if args.from_profile:
        return scaled_main(args)
    result = {"assumptions": {"model": vars(LLAMA_70B_Q3KM), "draft_bytes": TINYLLAMA_Q4KM_BYTES, "node": vars(NODE),
                              "links": LINKS, "split": "0.1,0.15x6/1", "prompt": PROMPT, "generated": GEN,
                              "options": {"n_draft": OPTS.n_draft, "p_accept": OPTS.p_accept,
                                          "max_inflight": OPTS.max_inflight}}}
    base = {a: row(predict_all(spec(), a)) for a in (0.5, 0.6, 0.7, 0.8, 0.9)}
    result["paper_setup_by_acceptance"] = base
    print(f"8 nodes (7 stages + draft rank), 1 Gbit/s; tok/s by acceptance (TTFT {base[0.7]['ttft_s']:.1f} s for "
          f"{PROMPT} prompt tokens; decode: after the first token)")
    print(f"{'accept':>6} {'iterative':>9} {'specul.':>8} {'pipeinfer':>9} {'pi/it':>6} {'pi/sp':>6} {'sp/it':>6}"
          f" {'decode pi/sp':>12}")
    for a, r in base.items():
        d = r["decode_tok_per_s"]
        print(f"{a:6.1f} {r['iterative']:9.2f} {r['speculative']:8.2f} {r['pipeinfer']:9.2f} "
              f"{r['pipeinfer_vs_iterative']:6.2f} {r['pipeinfer_vs_speculative']:6.2f} {r['speculative_vs_iterative']:6.2f}"
              f" {d['pipeinfer'] / d['speculative']:12.2f}")
    sweep = {}
    for name, link in LINKS.items():
        sweep[name] = {n: row(predict_all(spec(n, link), 0.7)) for n in (3, 4, 6, 8)}
    result["nodes_and_links_at_0.7"] = sweep
    print("\nspeedup of pipeinfer over iterative (over speculative) at acceptance 0.7")
    for name, by_n in sweep.items():
        print(f"{name:>11}: " + "  ".join(f"{n} nodes {r['pipeinfer_vs_iterative']:.2f} ({r['pipeinfer_vs_speculative']:.2f})"
                                         for n, r in by_n.items()))
    cross = {}
    for rc in (0.02, 0.1, 0.25, 0.5, 1.0):
        for ratio in (0.01, 0.02, 0.05, 0.1):
            node = replace(NODE, row_cost=rc)
            draft = int(ratio * LLAMA_70B_Q3KM.layer_bytes * LLAMA_70B_Q3KM.n_layer)
            cross[f"{rc}/{ratio}"] = row(predict_all(spec(node=node, draft_bytes=draft), 0.7))
    result["crossover_row_cost_by_draft_ratio_at_0.7"] = cross
    print("\nwinner at 8 nodes, 1 Gbit/s, acceptance 0.7: row cost (share of a row) x draft cost (share of the target)")
    for rc in (0.02, 0.1, 0.25, 0.5, 1.0):
        print(f"row cost {rc:4}: " + "  ".join(f"draft {ratio:4}: {cross[f'{rc}/{ratio}']['winner']:11}"
                                                 f"({cross[f'{rc}/{ratio}']['pipeinfer_vs_speculative']:.2f})"
                                                 for ratio in (0.01, 0.02, 0.05, 0.1)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    if args.png:
        _plot(sweep, args.png)


def measured_draft_bytes(prof, given: int | None) -> int:
    if given:
        return given
    from pipeinfer_cli.models.model_files import resolve_model
    from pipeinfer_cli.models.registry import load_registry

    if prof.draft is None or prof.draft.kind != "model":
        raise SystemExit("Error: the profile has no model draft; calibrate with --draft MODEL")
    try:
        return resolve_model(prof.draft.name, load_registry()).path.stat().st_size
    except Exception:
        raise SystemExit(f"Error: the profile's draft {prof.draft.name!r} is not an installed model; "
                         "give its file size with --measured-draft-bytes") from None


def scaled_main(args) -> None:
    from pipeinfer_cli.planner.search import search_settings
    from pipeinfer_cli.planner.profile import Profile
    from pipeinfer_cli.planner.project import scaled_profile

    measured = Profile.load(args.from_profile)
    draft_factor = TINYLLAMA_Q4KM_BYTES / measured_draft_bytes(measured, args.measured_draft_bytes)
    src = measured.model
    layer_factor = LLAMA_70B_Q3KM.layer_bytes / (sum(src.layer_bytes) / len(src.layer_bytes))
    r0 = measured.ranks[0]
    print(f"nodes from {args.from_profile}: {len(measured.ranks)} measured rank(s), {r0.threads} thread(s), "
          f"usable CPU {r0.usable_cpus}; layers x{layer_factor:.1f}, draft x{draft_factor:.1f} "
          f"(draft token {measured.draft.token_s * 1e3:.1f} ms -> {measured.draft.token_s * draft_factor * 1e3:.0f} ms)")
    result = {"profile": str(args.from_profile), "layer_factor": layer_factor, "draft_factor": draft_factor,
              "by_acceptance": {}, "by_nodes_at_0.7": {}, "search": {}}
    print(f"{'accept':>6} {'iterative':>9} {'specul.':>8} {'pipeinfer':>9} {'pi/it':>6} {'pi/sp':>6} {'sp/it':>6}")
    for acc in (0.5, 0.7, 0.9):
        r = row(predict_profile(scaled_profile(measured, LLAMA_70B_Q3KM, 8, draft_factor), 8, acc))
        result["by_acceptance"][acc] = r
        print(f"{acc:6.1f} {r['iterative']:9.3f} {r['speculative']:8.3f} {r['pipeinfer']:9.3f} "
              f"{r['pipeinfer_vs_iterative']:6.2f} {r['pipeinfer_vs_speculative']:6.2f} {r['speculative_vs_iterative']:6.2f}")
    print("speedup of pipeinfer over iterative (over speculative) at acceptance 0.7: " + "  ".join(
        f"{n} nodes {r['pipeinfer_vs_iterative']:.2f} ({r['pipeinfer_vs_speculative']:.2f})"
        for n in (3, 4, 6, 8)
        for r in [result["by_nodes_at_0.7"].setdefault(n, row(predict_profile(
            scaled_profile(measured, LLAMA_70B_Q3KM, n, draft_factor), n, 0.7)))]))
    prof8 = scaled_profile(measured, LLAMA_70B_Q3KM, 8, draft_factor)
    for mode in ("speculative", "pipeinfer"):
        found = search_settings(prof8, topology(8, mode), mode, trace_of(0.7), OPTS, 4096)
        best, speed = found.opts, found.tok_per_s
        result["search"][mode] = {"n_draft": best.n_draft, "p_accept": best.p_accept,
                                  "max_inflight": best.max_inflight, "tok_per_s": speed}
        print(f"plan --search, {mode} at acceptance 0.7: n_draft {best.n_draft}"
              + (f", p_accept {best.p_accept}, max_inflight {best.max_inflight}" if mode == "pipeinfer" else "")
              + f": {speed:.3f} tok/s")
    base = result["by_acceptance"][0.7]
    print(f"searched pipeinfer / iterative {result['search']['pipeinfer']['tok_per_s'] / base['iterative']:.2f}, "
          f"/ searched speculative {result['search']['pipeinfer']['tok_per_s'] / result['search']['speculative']['tok_per_s']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))


def _plot(sweep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    for name, by_n in sweep.items():
        ns = list(by_n)
        axes[0].plot(ns, [by_n[n]["pipeinfer_vs_iterative"] for n in ns], marker="o", label=name)
        axes[1].plot(ns, [by_n[n]["pipeinfer_vs_speculative"] for n in ns], marker="o", label=name)
    for ax, what in zip(axes, ("iterative", "speculative")):
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("nodes (stages + 1 draft rank)")
        ax.set_ylabel(f"pipeinfer / {what} (tok/s)")
        ax.legend(title="link rate")
        ax.grid(alpha=0.3)
    fig.suptitle("Projected: 70B Q3_K_M target, 1.1B draft, acceptance 0.7 (planner, stated node figures)")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
