"""The benchmark tables (rich): one row per mode, and median tok/s per prompt × mode."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from ..wording import plural
from .stats import per_prompt_medians


def _f(v, fmt: str = "{:.2f}", none: str = "–") -> str:
    return none if v is None else fmt.format(v)


def _x(v) -> str:
    return "–" if v is None else f"{v:.2f}×"


def mode_table(summary: dict[str, dict], modes: list[str], title: str) -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("mode")
    t.add_column("tok/s median (min–max)", justify="right")
    t.add_column("decode tok/s", justify="right")
    t.add_column("TTFT ms", justify="right")
    t.add_column("ITL p50/p90 ms", justify="right")
    t.add_column("accept", justify="right")
    t.add_column("acc. len", justify="right")
    t.add_column("runs launched/cancelled", justify="right")
    t.add_column("drafted/tok", justify="right")
    t.add_column("head own CPU", justify="right")
    has = {b: any(f"vs_{b}" in summary[m]["speedup"] for m in modes) for b in ("iterative", "speculative")}
    for b in ("iterative", "speculative"):
        if has[b]:
            t.add_column(f"× {b}", justify="right")
    t.add_column("tokens")
    for m in modes:
        s = summary[m]
        tps, dec = s["tok_per_s"], s["decode_tok_per_s"]
        row = [
            m,
            f"{_f(tps['median'])} ({_f(tps['min'])}–{_f(tps['max'])})",
            _f(dec["median"]),
            _f(None if s["ttft_s"] is None else s["ttft_s"] * 1e3, "{:.0f}"),
            f"{_f(s['itl_ms']['p50'], '{:.1f}')}/{_f(s['itl_ms']['p90'], '{:.1f}')}",
            _f(s["acceptance"]["rate"], "{:.0%}"),
            _f(s["acceptance"]["mean_accepted_len"]),
            f"{_f(s['runs']['launched'], '{:.1f}')}/{_f(s['runs']['cancelled'], '{:.1f}')}",
            _f(s["drafting"]["proposed_per_committed"]),
            _f(head_own_share(s), "{:.0%}"),
        ]
        row += [_x(s["speedup"].get(f"vs_{b}")) for b in ("iterative", "speculative") if has[b]]
        bad = s["mismatched_prompts"]
        row.append(Text(f"DIFFER on {plural(len(bad), 'prompt')}", style="bold red") if bad else Text("same", style="green"))
        t.add_row(*row)
    return t


def head_own_share(mode_summary: dict) -> float | None:
    """The head's own work (not its layers, not the draft model) as a share of its CPU seconds."""
    head = mode_summary.get("cpu_split", {}).get("0")
    return head["own_share"] if head else None


def prompt_table(records: list[dict], modes: list[str], mismatched: set[str]) -> Table:
    t = Table(title="median tok/s per prompt", title_justify="left")
    t.add_column("prompt")
    t.add_column("n_gen", justify="right")
    for m in modes:
        t.add_column(m, justify="right")
    t.add_column("tokens")
    med = per_prompt_medians(records, "tok_per_s")
    order: list[str] = []
    n_gen: dict[str, int] = {}
    for r in records:
        if r["prompt_id"] not in order:
            order.append(r["prompt_id"])
        n_gen.setdefault(r["prompt_id"], r["n_gen"])
    for pid in order:
        row = [pid, str(n_gen[pid])] + [_f(med.get(m, {}).get(pid)) for m in modes]
        row.append(Text("DIFFER", style="bold red") if pid in mismatched else Text("same", style="green"))
        t.add_row(*row)
    return t


def markdown_table(summary: dict[str, dict], modes: list[str]) -> str:
    """The mode table as GitHub markdown (for BENCHMARKS.md)."""
    bases = [b for b in ("iterative", "speculative") if any(f"vs_{b}" in summary[m]["speedup"] for m in modes)]
    head = ["mode", "tok/s median (min–max)", "decode tok/s", "TTFT ms", "ITL p50/p90 ms", "acceptance",
            "mean acc. len", "runs launched/cancelled", "drafted/tok", "head own CPU"] + [f"× {b}" for b in bases] + ["tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
    for m in modes:
        s = summary[m]
        tps = s["tok_per_s"]
        cells = [f"`{m}`", f"{_f(tps['median'])} ({_f(tps['min'])}–{_f(tps['max'])})", _f(s["decode_tok_per_s"]["median"]),
                 _f(None if s["ttft_s"] is None else s["ttft_s"] * 1e3, "{:.0f}"),
                 f"{_f(s['itl_ms']['p50'], '{:.1f}')} / {_f(s['itl_ms']['p90'], '{:.1f}')}",
                 _f(s["acceptance"]["rate"], "{:.0%}"), _f(s["acceptance"]["mean_accepted_len"]),
                 f"{_f(s['runs']['launched'], '{:.1f}')} / {_f(s['runs']['cancelled'], '{:.1f}')}",
                 _f(s["drafting"]["proposed_per_committed"]), _f(head_own_share(s), "{:.0%}")]
        cells += [_x(s["speedup"].get(f"vs_{b}")) for b in bases]
        cells.append(f"**differ on {plural(len(s['mismatched_prompts']), 'prompt')}**" if s["mismatched_prompts"] else "same")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def concurrency_table(rows: list[dict], title: str) -> Table:
    """`bench --concurrency`: one row per (mode, level), in run order (bench/concurrency.summarize)."""
    t = Table(title=title, title_justify="left")
    t.add_column("mode")
    t.add_column("concurrency", justify="right")
    t.add_column("requests", justify="right")
    t.add_column("tok/s", justify="right")
    t.add_column("× level 1", justify="right")
    t.add_column("req/s", justify="right")
    t.add_column("TTFT p50/p99 ms", justify="right")
    t.add_column("ITL p50/p99 ms", justify="right")
    t.add_column("decode tok/s per request", justify="right")
    t.add_column("text")
    for r in rows:
        failed = f" ({r['n_errors']} failed)" if r["n_errors"] else ""
        bad = r["mismatched_prompts"]
        if bad:
            same = Text(f"DIFFER on {plural(len(bad), 'prompt')}", style="bold red")
        elif r["identical_to_level_1"]:
            same = Text("same" if r["concurrency"] != 1 else "reference", style="green")
        else:
            same = Text("unchecked", style="yellow")
        t.add_row(
            r["mode"], str(r["concurrency"]), f"{r['n_requests']}{failed}", _f(r["tok_per_s"]),
            _x(r["tok_per_s_vs_level_1"]), _f(r["requests_per_s"]),
            f"{_f(r['ttft_ms']['p50'], '{:.0f}')}/{_f(r['ttft_ms']['p99'], '{:.0f}')}",
            f"{_f(r['itl_ms']['p50'], '{:.1f}')}/{_f(r['itl_ms']['p99'], '{:.1f}')}",
            _f(r["decode_tok_per_s_mean"]), same)
    return t
