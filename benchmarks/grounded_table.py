#!/usr/bin/env python3
"""Side-by-side table of the grounded benchmark: llama.cpp references and pipeinfer runs.

Reads the JSON of `benchmarks/llamacpp.py` (plain and --lookup) and of one or more
`pipeinfer bench` runs on the same prompts, and prints a Markdown table on stdout: per prompt the
end-to-end tok/s of every column, then the medians (end to end, decode, TTFT), pipeinfer's
acceptance, and each pipeinfer column's ratio to each llama.cpp column (geometric mean over prompts
of the per-prompt ratio). Every column's command is listed under the table.

    python -m benchmarks.grounded_table --ref build/grounded_llamacpp.json --ref build/grounded_llamacpp_lookup.json \\
        --bench build/grounded_lookup.json --bench build/grounded_pair.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.figures import median, paired_ratio, per_prompt
from benchmarks.report import markdown_table, publish


def ref_column(path: Path) -> dict:
    doc = json.loads(path.read_text())
    label = "llama.cpp lookup" if "prompt-lookup" in doc["engine"] else "llama.cpp"
    return {"label": f"{label} ({doc['threads']} thr)", "command": doc["command"], "kind": "ref",
            "records": {r["prompt_id"]: r for r in doc["records"] if r.get("repeat", 0) == 0}}


def bench_columns(path: Path) -> list[dict]:
    doc = json.loads(path.read_text())
    cfg = doc["header"]["config"]
    draft = doc["header"]["models"].get("draft") or {}
    name = "lookup" if draft.get("name") == "lookup" else "0.5B draft"
    cols = []
    for mode in cfg["modes"]:
        recs = {r["prompt_id"]: r for r in doc["records"] if r["mode"] == mode and not r["warmup"] and r["repeat"] == 0}
        cols.append({"label": f"pipeinfer `{mode}`" + (f" ({name})" if mode != "iterative" else ""),
                     "command": doc["header"]["command"], "kind": "pipeinfer", "records": recs,
                     "identical": doc["tokens_identical"]})
    return cols


def med(col: dict, key: str) -> float:
    value = median(r.get(key) for r in col["records"].values())
    return float("nan") if value is None else value


def geo_ratio(a: dict, b: dict) -> float:
    value = paired_ratio(per_prompt(a["records"].values()), per_prompt(b["records"].values()))
    return float("nan") if value is None else value


def table(cols: list[dict]) -> list[str]:
    prompts = list(cols[0]["records"])
    rows = [[p, str(cols[0]["records"][p]["n_prompt"])]
            + [f"{c['records'][p]['tok_per_s']:.2f}" if p in c["records"] else "–" for c in cols] for p in prompts]
    rows.append(["**median tok/s (end to end)**", ""] + [f"**{med(c, 'tok_per_s'):.2f}**" for c in cols])
    rows.append(["median decode tok/s", ""] + [f"{med(c, 'decode_tok_per_s'):.2f}" for c in cols])
    rows.append(["median TTFT s", ""] + [f"{med(c, 'ttft_s'):.2f}" for c in cols])
    acc = []
    for c in cols:
        recs = [r for r in c["records"].values() if r.get("acceptance", {}).get("drafted")]
        d = sum(r["acceptance"]["drafted"] for r in recs)
        acc.append(f"{sum(r['acceptance']['accepted'] for r in recs) / d:.0%}" if d else "–")
    rows.append(["acceptance", ""] + acc)
    return markdown_table(["prompt", "n_prompt"] + [c["label"] for c in cols], rows).splitlines()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", type=Path, action="append", default=[], help="bench_llamacpp.py JSON (repeatable)")
    ap.add_argument("--bench", type=Path, action="append", default=[], help="pipeinfer bench JSON (repeatable)")
    ap.add_argument("--markdown", type=Path, help="write the table here too")
    args = ap.parse_args()
    refs = [ref_column(p) for p in args.ref]
    pipe = [c for p in args.bench for c in bench_columns(p)]
    cols = refs + pipe
    if not cols:
        ap.error("give at least one --ref or --bench JSON")
    lines = table(cols)
    lines.append("")
    for c in pipe:
        if c["label"].startswith("pipeinfer") and refs:
            ratios = ", ".join(f"{geo_ratio(c, r):.2f}× {r['label']}" for r in refs)
            lines.append(f"- {c['label']}: {ratios}" + ("" if c["identical"] else " (**tokens differed between modes**)"))
    lines.append("")
    lines.append("Commands:")
    lines.append("")
    lines.append("```")
    seen = []
    for c in cols:
        if c["command"] not in seen:
            seen.append(c["command"])
            lines.append(c["command"])
    lines.append("```")
    publish("\n".join(lines), md_path=args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
