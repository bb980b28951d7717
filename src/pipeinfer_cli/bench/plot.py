"""The benchmark picture (PNG, matplotlib's Agg backend, imported lazily).

Top: tokens/s per mode — bars at the median over prompts × repeats, whiskers from min to max,
end-to-end tok/s and decode tok/s side by side. Below, one panel per mode: the per-rank
utilisation timeline of the same prompt (its first measured run), time in ms from the request's
start on the head's clock (one scale for all panels), one row per rank, coloured by what the rank
computes.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from ..wording import plural

DPI = 100
WIDTH_IN = 11.0
BAR_HEIGHT_IN = 3.2
TIMELINE_HEIGHT_IN = 1.9

COLORS = {"prefill": "#8c8c8c", "decode": "#1f77b4", "verify": "#ff7f0e", "draft": "#2ca02c", "cancelled": "#d62728"}


def figure_size_px(n_modes: int) -> tuple[int, int]:
    """(width, height) of the PNG for n_modes modes."""
    return round(WIDTH_IN * DPI), round((BAR_HEIGHT_IN + TIMELINE_HEIGHT_IN * n_modes) * DPI)


def _slice_kind(name: str, args: dict) -> str:
    if name == "draft":
        return "draft"
    if args.get("cancelled"):
        return "cancelled"
    if args.get("spec"):
        return "verify"
    return "prefill" if (args.get("n_tokens") or 1) > 1 else "decode"


def pick_timeline_records(records: list[dict], modes: list[str]) -> dict[str, dict]:
    """For each mode, the first measured record of the first prompt (a warmup only if nothing else)."""
    measured = [r for r in records if not r["warmup"]] or records
    if not measured:
        return {}
    pid = measured[0]["prompt_id"]
    out = {}
    for mode in modes:
        rec = next((r for r in measured if r["mode"] == mode and r["prompt_id"] == pid), None)
        if rec is not None:
            out[mode] = rec
    return out


def _timeline(ax, rec: dict, x_max_ms: float) -> None:
    t0 = rec["t_start"]
    span_ms = max((rec["t_end"] - t0) * 1e3, 1e-6)
    ranks = sorted(rec["ranks"], key=lambda r: r["rank"])
    labels = []
    for row, r in enumerate(ranks):
        off = r.get("clock_offset_s", 0.0)
        by_kind: dict[str, list[tuple[float, float]]] = {}
        busy = 0.0
        for kind, name, a, b, args in r.get("trace") or ():
            if kind != "X":
                continue
            start, dur = (a - off - t0) * 1e3, (b - a) * 1e3
            by_kind.setdefault(_slice_kind(name, args or {}), []).append((start, max(dur, span_ms * 1e-4)))
            busy += dur
        for k, bars in by_kind.items():
            ax.broken_barh(bars, (row - 0.38, 0.76), facecolors=COLORS[k], linewidth=0)
        labels.append(f"rank {r['rank']} {r['role']}\n{min(busy / span_ms, 1.0):.0%} busy")
    for r in rec["ranks"]:
        if r["rank"] == 0:
            for kind, name, a, _b, _args in r.get("trace") or ():
                if kind == "i" and name == "cancel":
                    ax.axvline((a - t0) * 1e3, color=COLORS["cancelled"], linewidth=0.6, alpha=0.5)
    ax.set_yticks(range(len(ranks)), labels, fontsize=8)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, max(x_max_ms, span_ms))
    tps = rec.get("tok_per_s")
    ax.set_title(f"{rec['mode']}: prompt {rec['prompt_id']!r}, {plural(rec['n_gen'], 'token')}"
                 + (f", {tps:.1f} tok/s" if tps else ""), fontsize=10, loc="left")
    ax.set_xlabel("time since request start (ms, head clock)", fontsize=8)
    ax.grid(axis="x", alpha=0.3)


def write_plot(path: Path, summary: dict[str, dict], records: list[dict], modes: list[str], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    w, h = figure_size_px(len(modes))
    fig = plt.figure(figsize=(w / DPI, h / DPI), dpi=DPI)
    heights = [BAR_HEIGHT_IN] + [TIMELINE_HEIGHT_IN] * len(modes)
    gs = fig.add_gridspec(len(heights), 1, height_ratios=heights, hspace=0.95, left=0.13, right=0.98, top=0.88, bottom=0.06)

    ax = fig.add_subplot(gs[0])
    x = range(len(modes))
    width = 0.38
    for i, (key, label, color) in enumerate((("tok_per_s", "end-to-end tok/s (incl. prompt)", "#4c72b0"),
                                            ("decode_tok_per_s", "decode tok/s", "#dd8452"))):
        med = [summary[m][key]["median"] or 0.0 for m in modes]
        lo = [med[j] - (summary[m][key]["min"] or med[j]) for j, m in enumerate(modes)]
        hi = [(summary[m][key]["max"] or med[j]) - med[j] for j, m in enumerate(modes)]
        xs = [j + (i - 0.5) * width for j in x]
        bars = ax.bar(xs, med, width, yerr=[lo, hi], capsize=4, color=color, label=label + " — median, min–max")
        ax.bar_label(bars, labels=[f"{v:.1f}" for v in med], padding=2, fontsize=8)
    ax.set_xticks(list(x), modes)
    ax.set_ylabel("tokens / s")
    ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=2, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.15)
    fig.suptitle("\n".join(textwrap.wrap(title, 120)), fontsize=10, x=0.01, ha="left")

    chosen = pick_timeline_records(records, modes)
    # One time scale for every mode, so the panels compare at a glance.
    x_max_ms = max(((r["t_end"] - r["t_start"]) * 1e3 for r in chosen.values()), default=1.0)
    for i, mode in enumerate(modes):
        tax = fig.add_subplot(gs[i + 1])
        if mode in chosen:
            _timeline(tax, chosen[mode], x_max_ms)
        else:
            tax.set_title(f"{mode}: no record", fontsize=10, loc="left")
        if i == 0:
            handles = [Patch(color=c, label=k) for k, c in COLORS.items()]
            tax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles),
                       fontsize=8, frameon=False)
    fig.savefig(path, dpi=DPI, format="png")
    plt.close(fig)
