"""docs/layout.md cannot go stale: every module of the package is named in it, in the row (or
paragraph) of its folder, and every module it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "pipeinfer_cli"
LAYOUT = ROOT / "docs" / "layout.md"


def _modules() -> set[str]:
    return {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")
            if p.name not in ("__init__.py", "__main__.py") and "__pycache__" not in p.parts}


def _named() -> tuple[set[str], list[str]]:
    """(modules the layout names, names that resolve to no module). A bare `name.py` in a line
    belongs to the folder of the last `folder/...` path named before it on that line, else to the
    package root; paths outside the package (tests/, scripts/) are not modules."""
    folders = {p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__"}
    named, missing = set(), []
    for line in LAYOUT.read_text().splitlines():
        folder = ""
        for token in re.findall(r"`([\w./]+)`", line):
            if "/" in token:
                if token.split("/")[0] not in folders:
                    continue
                folder = token.rsplit("/", 1)[0] if token.endswith(".py") else token.rstrip("/")
            if not token.endswith(".py"):
                continue
            candidates = [token] if "/" in token else [f"{folder}/{token}", token] if folder else [token]
            found = next((c for c in candidates if (SRC / c).is_file()), None)
            if found:
                named.add(found)
            else:
                missing.append(candidates[0])
    return named, missing


def test_every_module_is_in_the_layout():
    named, _ = _named()
    absent = sorted(_modules() - named)
    assert not absent, "modules docs/layout.md does not name (add them to their folder's row): " + ", ".join(absent)


def test_every_module_the_layout_names_exists():
    _, missing = _named()
    assert not missing, "docs/layout.md names modules that do not exist: " + ", ".join(missing)


def test_the_rooms_match_the_docstrings():
    """The tables after "The rooms" are what scripts/layout_rooms.py generates from the modules."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import layout_rooms

    assert LAYOUT.read_text().endswith(layout_rooms.rooms()), "docs/layout.md is stale: run python scripts/layout_rooms.py"
