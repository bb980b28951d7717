"""What batching two requests' runs into one graph would save on this CPU (serve --parallel).

Two requests each need one decode row on a stage. Today the stage computes them one after the
other (two one-row graphs). One graph with both rows would be the batch-invariant graph (so both
rows stay bit-identical): it slices the matmuls back into one-row kernels, so what it could save is
the graph's fixed cost and, on a node whose weights do not stay in cache, the second read of the
weights. The matmuls are what batching changes, so the two rows here are two positions of one
sequence (in plain decoding's cell layout, as each slot's rows are), after `--ctx` prompt tokens:

  two_graphs       two one-row evals (what serve --parallel does)
  one_invariant    one two-row batch-invariant eval (lossless batching)
  one_plain        one two-row eval with the batched kernels (not lossless: rounding changes)

    .venv/bin/python -m benchmarks.parallel_batch qwen2.5-coder-1.5b-instruct --ctx 512 --json build/batch.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.report import markdown_table, publish
from pipeinfer_cli.native import LayerEngine
from pipeinfer_cli.models.model_files import resolve_model
from pipeinfer_cli.models.registry import load_registry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=512, help="tokens already in each sequence")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    path = str(resolve_model(args.model, load_registry()).path)
    n_layer = LayerEngine(path, 0, 1, n_ctx=256).n_layer
    eng = LayerEngine(path, 0, n_layer, n_ctx=args.ctx + 512, n_seq_max=2, n_threads=args.threads)
    for b in range(0, args.ctx, 256):
        n = min(256, args.ctx - b)
        eng.eval(tokens=[100] * n, pos=list(range(b, b + n)), seq_ids=[[0]] * n)
    pos = args.ctx

    def two_graphs() -> None:
        for p in (pos, pos + 1):
            eng.eval(tokens=[7], pos=[p], seq_ids=[[0]], output=[True], batch_invariant=True)

    def one_graph(invariant: bool):
        return lambda: eng.eval(tokens=[7, 7], pos=[pos, pos + 1], seq_ids=[[0], [0]], output=[True, True],
                                batch_invariant=invariant)

    cases = {"two_graphs": two_graphs, "one_invariant": one_graph(True), "one_plain": one_graph(False)}
    times = {k: [] for k in cases}
    for _ in range(args.reps):
        for name, fn in cases.items():  # interleaved: the machine's noise hits every case alike
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            eng.seq_rm(0, pos, -1)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out = {"model": args.model, "ctx": args.ctx, "threads": args.threads, "reps": args.reps,
           "median_ms": {k: round(v, 2) for k, v in med.items()},
           "one_invariant_vs_two_graphs": round(med["one_invariant"] / med["two_graphs"], 3),
           "one_plain_vs_two_graphs": round(med["one_plain"] / med["two_graphs"], 3)}
    publish(markdown_table(["case", "median ms", "× two graphs"],
                           [[k, f"{v:.2f}", f"{v / med['two_graphs']:.3f}"] for k, v in med.items()]), out, args.json)


if __name__ == "__main__":
    main()
