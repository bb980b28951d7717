"""The planner's JSON files (profiles, traces): read with one clear error, written whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path


def read_json(path: Path, error: type[Exception], what: str, missing_hint: str):
    """The parsed file; `error` naming the file when it is missing (with missing_hint) or unreadable."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"no {what} at {path}; {missing_hint}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"cannot read the {what} {path}: {e}") from None


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and a rename: the file is whole or absent."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
