#!/usr/bin/env python3
"""The scaling curve as a PNG: tok/s (end to end, and decoding) against the number of hosts, one
line per configuration, one column per benchmarks/scaling.py JSON (a prompt set and a link rate).

    .venv/bin/python -m benchmarks.cluster_plot build/cluster_default.json build/cluster_grounded.json --out docs/cluster.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def panel(ax, doc: dict, title: str, key: str = "tok_per_s") -> None:
    rows = [r for r in doc["rows"] if r.get(key) and not r.get("mem_per_host")]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    for label in labels:
        pts = sorted((r["hosts"], r[key]) for r in rows if r["label"] == label)
        style = "--" if label == "iterative" else ("-." if label.startswith("speculative") else "-")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label.replace("qwen2.5-coder-", "")
                .replace("-instruct", ""))
    hosts = sorted({r["hosts"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(hosts, [str(h) for h in hosts])
    ax.set_xlabel(f"hosts ({doc.get('total_cpus', 2):g} CPUs in all, 2/N each)")
    ax.set_ylabel("tok/s (end to end)" if key == "tok_per_s" else "decode tok/s (after the first token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path("docs/cluster.png"))
    a = p.parse_args()
    docs = [(f, json.loads(f.read_text())) for f in a.json if f.exists()]
    fig, axes = plt.subplots(2, len(docs), figsize=(5.2 * len(docs), 8.4), squeeze=False)
    for col, (f, doc) in enumerate(docs):
        rate = ",".join(sorted({r["rate"] for r in doc["rows"]}))
        for row, key in enumerate(("tok_per_s", "decode_tok_per_s")):
            panel(axes[row][col], doc, f"Qwen2.5-Coder-1.5B, {doc['prompts']} prompts, {rate}, -n {doc['n_predict']}", key)
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
