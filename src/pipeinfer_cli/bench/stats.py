"""Per-mode summary of the measured (non-warmup) records.

- tok/s and decode tok/s: median, min and max over every (prompt, repeat) of the mode;
- TTFT, ITL p50 and p90: median over records of each record's value;
- acceptance rate: pooled, sum(accepted) / sum(drafted); mean accepted length: median over records;
- runs launched / cancelled: mean per request;
- drafting: pooled, tokens the drafter proposed and launched, and both per committed token;
- cpu_split: per rank, the CPU seconds of every record summed by kind of work (stage, draft, own,
  own_wait), with the rank's cpu_s and own_share (own_s / cpu_s);
- speedup of mode M over base B: geometric mean over prompts of median tok/s(M) / median tok/s(B)
  on that prompt — paired by prompt, so a mode is never flattered by having easier prompts.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

BASELINES = ("iterative", "speculative")


def _values(records: list[dict], get) -> list[float]:
    out = []
    for r in records:
        try:
            v = get(r)
        except (KeyError, TypeError):
            v = None
        if v is not None:
            out.append(float(v))
    return out


def _spread(vals: list[float]) -> dict:
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def _median(vals: list[float]) -> float | None:
    return statistics.median(vals) if vals else None


def _mean(vals: list[float]) -> float | None:
    return statistics.fmean(vals) if vals else None


def per_prompt_medians(records: list[dict], key: str = "tok_per_s") -> dict[str, dict[str, float]]:
    """{mode: {prompt_id: median of key over the measured repeats}}."""
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in records:
        if not r["warmup"] and r.get(key) is not None:
            groups[(r["mode"], r["prompt_id"])].append(r[key])
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for (mode, pid), vals in groups.items():
        out[mode][pid] = statistics.median(vals)
    return out


def speedup(medians: dict[str, dict[str, float]], mode: str, base: str) -> float | None:
    """Geometric mean over the prompts both modes ran of the ratio of median tok/s."""
    a, b = medians.get(mode, {}), medians.get(base, {})
    ratios = [a[p] / b[p] for p in a if p in b and b[p] > 0 and a[p] > 0]
    return math.exp(statistics.fmean(math.log(x) for x in ratios)) if ratios else None


def _run_keys(records: list[dict]) -> list[str]:
    """The run counters the records carry (docs/json-output.md, plus any the engine adds), in first-seen order."""
    keys = ["launched", "speculative", "cancelled", "cancelled_mid_compute", "layer_evals_skipped"]
    for r in records:
        keys += [k for k in r["runs"] if k not in keys]
    return keys


def _by_source(rs: list[dict]) -> dict:
    """Hybrid drafting: {"by_source": {source: drafted, accepted, rate}} pooled over the records; {} otherwise."""
    pooled: dict[str, list[int]] = {}
    for r in rs:
        for src, row in r["acceptance"].get("by_source", {}).items():
            acc = pooled.setdefault(src, [0, 0])
            acc[0] += row["drafted"]
            acc[1] += row["accepted"]
    if not pooled:
        return {}
    return {"by_source": {s: {"drafted": d, "accepted": a, "rate": a / d if d else None} for s, (d, a) in sorted(pooled.items())}}


def _drafting(rs: list[dict]) -> dict:
    """Tokens proposed and launched, pooled over the records, and per committed token."""
    n_gen = sum(r["n_gen"] for r in rs)
    proposed = sum((r.get("drafting") or {}).get("proposed", 0) for r in rs)
    launched = sum((r.get("drafting") or {}).get("launched", 0) for r in rs)
    return {"proposed": proposed, "launched": launched,
            "proposed_per_committed": proposed / n_gen if n_gen else None,
            "launched_per_committed": launched / n_gen if n_gen else None}


CPU_KINDS = ("stage_s", "draft_s", "own_s", "own_wait_s")


def _cpu_split(rs: list[dict]) -> dict:
    """{rank: {role, cpu_s, stage_s, draft_s, own_s, own_wait_s, own_share}} summed over the records."""
    out: dict[str, dict] = {}
    for r in rs:
        for rank in r.get("ranks", []):
            split = rank.get("cpu_split")
            if split is None:
                continue
            row = out.setdefault(str(rank["rank"]), {"role": rank["role"], "cpu_s": 0.0, **{k: 0.0 for k in CPU_KINDS}})
            row["cpu_s"] += rank["cpu_s"]
            for k in CPU_KINDS:
                row[k] += split[k]
    for row in out.values():
        total = row["stage_s"] + row["draft_s"] + row["own_s"]
        row["own_share"] = row["own_s"] / total if total > 0 else None
    return out


def summarize(records: list[dict], modes: list[str], mismatches: list[dict]) -> dict[str, dict]:
    measured = [r for r in records if not r["warmup"]]
    tok_medians = per_prompt_medians(records, "tok_per_s")
    dec_medians = per_prompt_medians(records, "decode_tok_per_s")
    out: dict[str, dict] = {}
    for mode in modes:
        rs = [r for r in measured if r["mode"] == mode]
        drafted = sum(r["acceptance"]["drafted"] for r in rs)
        accepted = sum(r["acceptance"]["accepted"] for r in rs)
        out[mode] = {
            "n_records": len(rs),
            "n_gen": sum(r["n_gen"] for r in rs),
            "tok_per_s": _spread(_values(rs, lambda r: r["tok_per_s"])),
            "decode_tok_per_s": _spread(_values(rs, lambda r: r["decode_tok_per_s"])),
            "ttft_s": _median(_values(rs, lambda r: r["ttft_s"])),
            "itl_ms": {"p50": _median(_values(rs, lambda r: r["itl_ms"]["p50"])),
                       "p90": _median(_values(rs, lambda r: r["itl_ms"]["p90"]))},
            "acceptance": {"drafted": drafted, "accepted": accepted,
                           "rate": accepted / drafted if drafted else None,
                           "mean_accepted_len": _median(_values(rs, lambda r: r["acceptance"]["mean_accepted_len"])),
                           **_by_source(rs)},
            "runs": {k: _mean(_values(rs, lambda r, k=k: r["runs"][k])) for k in _run_keys(rs)},
            "drafting": _drafting(rs),
            "cpu_split": _cpu_split(rs),
            "speedup": {f"vs_{b}": speedup(tok_medians, mode, b) for b in BASELINES if b in modes},
            "decode_speedup": {f"vs_{b}": speedup(dec_medians, mode, b) for b in BASELINES if b in modes},
            "mismatched_prompts": sorted({m["prompt_id"] for m in mismatches if m["mode"] == mode}),
        }
    return out
