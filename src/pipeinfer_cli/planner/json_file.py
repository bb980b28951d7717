"""The planner's JSON files (profiles, traces): read with one clear error, written whole or not at all."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import threading
from pathlib import Path


def read_json(path: Path, error: type[Exception], what: str, missing_hint: str):
    """The parsed file; `error` naming the file when it is missing (with missing_hint) or unreadable."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"no {what} at {path}; {missing_hint}") from None
    except json.JSONDecodeError as e:
        raise error(f"the {what} {path} is not valid JSON ({e}); {missing_hint}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"cannot read the {what} {path}: {e}") from None


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file beside it, flushed to disk, and a rename: the file is whole or
    absent (or still the previous one), whatever stops the write (an error, Ctrl-C, the SIGTERM that
    stops a job's ranks); the temporary file is removed on the way out unless the process is killed
    outright (SIGKILL)."""
    path = Path(path)
    with _sigterm_raises():
        _write_through_temp(path, text)


def _write_through_temp(path: Path, text: str) -> None:
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


class Stopped(KeyboardInterrupt):
    """SIGTERM arrived while a file was being written (handled like Ctrl-C, then re-raised)."""


@contextlib.contextmanager
def _sigterm_raises():
    """On the main thread: SIGTERM raises `Stopped` inside the block (so that the temporary file is
    removed), then the previous handler is back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        raise Stopped(f"stopped by {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
