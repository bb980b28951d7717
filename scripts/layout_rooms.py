#!/usr/bin/env python3
"""Regenerate the "The rooms" tables at the end of docs/layout.md from the modules' docstrings
(the first paragraph of each), in the order of the data path. tests/test_layout_doc.py checks the
result names every module.

    python scripts/layout_rooms.py
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "pipeinfer_cli"
LAYOUT = ROOT / "docs" / "layout.md"
ORDER = ["cli", "server", "bench", "runtime", "planner", "decode", "transport", "models", ""]
MARK = "## The rooms"


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
    return "\n".join(out) + "\n"


def main() -> None:
    text = LAYOUT.read_text()
    head, _, rest = text.partition(MARK)
    intro = rest.split("\n### ", 1)[0]
    LAYOUT.write_text(head + MARK + intro.rstrip("\n") + "\n" + rooms())


if __name__ == "__main__":
    main()
