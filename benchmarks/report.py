"""The one table and JSON writer every benchmark publishes through: a Markdown table under a line that
names the machine (its CPU model, cores, memory, load), the same machine facts in the --json
document, and the table also written to a file (--markdown) so that no shell pipe can hide the
benchmark's exit status.

    from benchmarks.report import Column, publish, render
    cols = [Column("config", lambda r: r["label"], "l"), Column("tok/s", lambda r: fmt_spread(r["tok_per_s"]))]
    publish(render(cols, rows), {"rows": rows}, json_path=a.json, md_path=a.markdown)

A table is a list of Columns, each a heading and a function of the row, so a benchmark grows a
column by appending one (benchmarks/scaling.py builds extra ones from paths into the job's JSON).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Column:
    """One column: its heading, the cell text of a row, and l (names) or r (figures)."""

    head: str
    cell: Callable[[dict], str]
    align: str = "r"


def fmt(v, spec: str = ".2f", suffix: str = "", none: str = "–") -> str:
    """A figure, or `none` when there is none."""
    return none if v is None else f"{v:{spec}}{suffix}"


def fmt_spread(s: dict | None, spec: str = ".2f", none: str = "–") -> str:
    """A repeated figure as `median (min–max)` (just the median when it was measured once)."""
    if not s or s.get("median") is None:
        return none
    if s.get("n", 1) < 2 or s["min"] == s["max"]:
        return f"{s['median']:{spec}}"
    return f"{s['median']:{spec}} ({s['min']:{spec}}–{s['max']:{spec}})"


def markdown_table(head: list[str], rows: list[list[str]], align: str = "") -> str:
    """A Markdown table. align: one letter per column, l (names) or r (figures); the default is
    the first column left and the others right."""
    align = align or "l" + "r" * (len(head) - 1)
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
                      *("| " + " | ".join(r) + " |" for r in rows)])


def render(columns: list[Column], rows: list[dict]) -> str:
    """The Markdown table of rows, one cell per column."""
    return markdown_table([c.head for c in columns], [[c.cell(r) for c in columns] for r in rows],
                          "".join(c.align for c in columns))


def machine() -> dict:
    """The facts of this machine that every table names: CPU model, cores, memory, OS, load."""
    from pipeinfer_cli.bench.environment import host_facts

    facts = host_facts()
    return {k: facts.get(k) for k in ("cpu_model", "cores", "cores_usable", "mem_total_gib", "os", "load_avg")}


def machine_line(m: dict) -> str:
    """One line naming the machine, printed above every table."""
    load = f"; load {' / '.join(map(str, m['load_avg']))} (1/5/15 min)" if m.get("load_avg") else ""
    return (f"Machine: {m.get('cpu_model') or 'unknown CPU'}, {m.get('cores')} cores ({m.get('cores_usable')} usable), "
            f"{m.get('mem_total_gib')} GiB, {m.get('os')}{load}.")


def write_json(path: Path | str | None, doc: dict, indent: int | None = 1) -> None:
    """The --json document, its directory made; announced on stderr."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent, default=str) + "\n")
    print(f"wrote {path}", file=sys.stderr, flush=True)


def publish(table: str, doc: dict | None = None, json_path: Path | str | None = None,
            md_path: Path | str | None = None, notes: list[str] | None = None) -> dict:
    """Print the table under the machine's line (and notes under it), write it to md_path and the
    document, with the machine's facts added as `machine`, to json_path. Returns the document."""
    m = machine()
    text = "\n\n".join([machine_line(m), table, *(notes or [])]) + "\n"
    print(text, end="", flush=True)
    if md_path is not None:
        Path(md_path).parent.mkdir(parents=True, exist_ok=True)
        Path(md_path).write_text(text)
    doc = {"machine": m, **(doc or {})}
    write_json(json_path, doc)
    return doc
