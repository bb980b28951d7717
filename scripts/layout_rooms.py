#!/usr/bin/env python3
"""Regenerate the "The rooms" tables at the end of docs/layout.md from the modules' docstrings
(the first paragraph of each), in the order of the data path, and the tables of scripts/, benchmarks/
and cluster/ (each file's first paragraph, and the make targets that run it). tests/test_layout_doc.py checks the
result names every module.

    python scripts/layout_rooms.py
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "pipeinfer_cli"
LAYOUT = ROOT / "docs" / "layout.md"
ORDER = ["cli", "server", "bench", "runtime", "planner", "decode", "transport", "models", ""]
MARK = "## The rooms"


def _first_paragraph(path: Path) -> str:
    """A Python file's docstring, or a shell file's leading comment, up to its first blank line."""
    text = path.read_text()
    if path.suffix == ".py":
        para = (ast.get_docstring(ast.parse(text)) or "").split("\n\n")[0]
    else:
        lines = [x for x in text.splitlines() if not x.startswith("#!")]
        comment = []
        for line in lines:
            if not line.startswith("#") or not line.strip("# "):
                break
            comment.append(line.lstrip("# "))
        para = " ".join(comment)
    first = " ".join(para.split())
    if len(first) > 260:
        first = first[:257].rsplit(" ", 1)[0] + " …"
    return first.replace("|", chr(92) + "|")


def _make_targets() -> dict[str, list[str]]:
    """{script file name: the make targets whose recipe runs it}; a file target such as
    $(VENV)/.deps-stamp is named by the target that needs it (deps)."""
    runs: dict[str, list[str]] = {}
    prereqs: dict[str, str] = {}
    target = None
    for line in (ROOT / "Makefile").read_text().splitlines():
        if m := re.match(r"^([\w.$()/-]+):(.*)", line):
            target = m.group(1)
            prereqs[target] = m.group(2)
        elif line.startswith("\t") and target:
            names = re.findall(r"((?:scripts|benchmarks|cluster)/[\w.-]+)", line)
            names += [f"benchmarks/{m}.py" for m in re.findall(r"-m benchmarks\.(\w+)", line)]
            if "$(CLUSTER)" in line:
                names.append("benchmarks/scaling.py")
            for name in names:
                runs.setdefault(name, [])
                if target not in runs[name]:
                    runs[name].append(target)

    def named(t: str) -> str:
        for _ in range(5):  # file targets needed by file targets, a few deep at most
            if not t.startswith("$"):
                break
            t = next((u for u, pre in prereqs.items() if t in pre.split()), t)
        return t

    return {name: list(dict.fromkeys(named(t) for t in ts)) for name, ts in runs.items()}


FOLDERS = {
    "scripts": "Outside the package: what `make` runs to install and check (install, ASan, the fault matrix, "
               "the soak), the emulated cluster's command, and the launch files for a real cluster.",
    "benchmarks": "The benchmarks (`python -m benchmarks.NAME`, the `bench-*` targets): one runner, one table and "
                  "JSON writer, one emulated-cluster fixture, shared by every benchmark.",
    "cluster": "The emulated cluster (scripts/emulate-cluster.sh): hosts as network namespaces with rate-limited "
               "links and their own cgroups.",
}


def scripts_room() -> list[str]:
    targets = _make_targets()
    out = []
    for folder, what in FOLDERS.items():
        out += [f"\n### `{folder}/`\n", what + "\n", "| file | what it does | make |", "|---|---|---|"]
        for p in sorted(x for x in (ROOT / folder).iterdir() if x.is_file() and x.name != "__init__.py"):
            made = ", ".join(f"`{t}`" for t in targets.get(f"{folder}/{p.name}", [])) or "–"
            out.append(f"| `{folder}/{p.name}` | {_first_paragraph(p)} | {made} |")
    return out


def rooms() -> str:
    out = []
    for folder in ORDER:
        d = SRC / folder if folder else SRC
        out += [f"\n### `{folder}/`\n" if folder else "\n### the package root\n", "| module | what it holds |",
                "|---|---|"]
        for p in sorted(x for x in d.glob("*.py") if x.name not in ("__init__.py", "__main__.py")):
            first = " ".join((ast.get_docstring(ast.parse(p.read_text())) or "").split("\n\n")[0].split())
            if len(first) > 260:
                first = first[:257].rsplit(" ", 1)[0] + " …"
            out.append(f"| `{(folder + '/' if folder else '') + p.name}` | {first.replace('|', chr(92) + '|')} |")
    return "\n".join(out + scripts_room()) + "\n"


def main() -> None:
    text = LAYOUT.read_text()
    head, _, rest = text.partition(MARK)
    intro = rest.split("\n### ", 1)[0]
    LAYOUT.write_text(head + MARK + intro.rstrip("\n") + "\n" + rooms())


if __name__ == "__main__":
    main()
