"""The planner's JSON files (profiles, traces): read with one clear error, written whole or not at all."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
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
    """Write through a temporary file beside it, flushed to disk, and a rename: the file is whole or
    absent (or still the previous one), whatever stops the write (an error, Ctrl-C); the temporary
    file is removed on the way out unless the process is killed outright."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # as a plain open() would have made it (mkstemp makes 0600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
