"""docs/environment.md lists every `PIPEINFER_*` variable the code reads (README: "every variable")."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bPIPEINFER_[A-Z0-9_]*[A-Z0-9]\b")


def _names_in(*dirs: str, suffixes=(".py", ".cpp", ".h", ".sh")) -> dict[str, str]:
    """Every PIPEINFER_* name written in these directories' sources, with a file that names it."""
    found: dict[str, str] = {}
    for d in dirs:
        for path in sorted((ROOT / d).rglob("*")):
            if path.suffix in suffixes and path.is_file():
                for name in NAME.findall(path.read_text(errors="replace")):
                    found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_the_code_reads_its_variables_from_the_environment():
    """The names below are the ones the code reads: through os.environ / getenv, by a constant or
    directly (a failing check here means the scan finds nothing, not that the docs are complete)."""
    names = _names_in("src")
    assert {"PIPEINFER_CACHE", "PIPEINFER_SWA_FULL", "PIPEINFER_DEBUG_STREAM_RATE", "PIPEINFER_START_TIMEOUT"} <= set(names)


def test_every_variable_the_code_reads_is_in_environment_md():
    documented = set(NAME.findall((ROOT / "docs" / "environment.md").read_text()))
    names = _names_in("src", "native", "scripts", "benchmarks", "cluster")
    missing = {n: where for n, where in names.items() if n not in documented}
    assert not missing, f"add these to docs/environment.md: {missing}"
