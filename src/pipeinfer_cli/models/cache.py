"""Where downloaded models live: PIPEINFER_CACHE, else $XDG_CACHE_HOME/pipeinfer, else ~/.cache/pipeinfer."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..errors import CacheError
from .registry import ModelEntry


def cache_dir() -> Path:
    if os.environ.get("PIPEINFER_CACHE"):
        return Path(os.environ["PIPEINFER_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pipeinfer"


def cached_model_path(entry: ModelEntry) -> Path:
    """Path the assembled file of a registry model has in the cache (it may not exist yet)."""
    return cache_dir() / entry.file


def ensure_writable_cache() -> Path:
    """Create the cache directory if needed and check that files can be written there."""
    root = cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CacheError(
            f"cannot create the model cache {root}: {e.strerror}; set PIPEINFER_CACHE to a writable directory"
        ) from None
    reason = None if os.access(root, os.W_OK | os.X_OK) else "permission denied"
    if reason is None:
        try:  # also catches what access() does not: a read-only file system, or root on one
            probe_write(root)
        except OSError as e:
            reason = (e.strerror or str(e)).lower()
    if reason:
        raise CacheError(
            f"the model cache {root} is not writable ({reason}); fix its permissions or set PIPEINFER_CACHE to a writable directory"
        )
    return root


def probe_write(root: Path) -> None:
    """OSError unless a file can be created (and removed) in root."""
    fd, name = tempfile.mkstemp(prefix=".pipeinfer-write-test-", dir=root)
    os.close(fd)
    os.unlink(name)
