"""Check output paths before anything slow happens (model pulls, loading, minutes of benchmark)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..errors import UsageError


class OutputPathError(UsageError):
    """An output file cannot be written."""


def check_output_paths(paths: dict[str, Path | None]) -> None:
    """Each given path (keyed by its option name) must be a writable file location, all distinct.

    The parent directory must exist and accept a new file (probed with a temporary file that is
    removed at once); an existing target must be a writable regular file.
    """
    seen: dict[Path, str] = {}
    for opt, path in paths.items():
        if path is None:
            continue
        resolved = path.expanduser().resolve()
        if resolved in seen:
            raise OutputPathError(f"{opt} and {seen[resolved]} both write {path}; give them different files")
        seen[resolved] = opt
        parent = resolved.parent
        if not parent.is_dir():
            raise OutputPathError(f"{opt} {path}: directory {parent} does not exist; create it first")
        if resolved.is_dir():
            raise OutputPathError(f"{opt} {path} is a directory; give a file name")
        if resolved.exists() and not os.access(resolved, os.W_OK):
            raise OutputPathError(f"{opt} {path} exists and is not writable")
        try:
            with tempfile.NamedTemporaryFile(dir=parent, prefix=".pipeinfer-bench-", delete=True):
                pass
        except OSError as e:
            raise OutputPathError(f"{opt} {path}: cannot write in {parent} ({e.strerror})") from None
