"""The node cache's size cap: before a rank writes a streamed file, the files no job used for the
longest are removed until the new one fits under the cap; and a file that a newer one of the same
model includes (a slice inside a wider slice, any slice once a whole copy is cached) is removed
when that newer one is written.

The cap is PIPEINFER_NODE_CACHE_MAX (`16G`, `500M`, a number of bytes, or `none`), by default
16 GiB or a quarter of the file system that holds the cache, whichever is smaller. Files a rank is
about to read (the sources of the file it writes, its own file) are never removed; a file larger
than the cap on its own is still written, after every other one is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from ..errors import UsageError
from . import slice_cache

MAX_ENV = "PIPEINFER_NODE_CACHE_MAX"
DEFAULT_MAX = 16 << 30
DEFAULT_DISK_SHARE = 4  # at most a quarter of the cache's file system by default
RECENT_S = 60.0  # a file used this recently may be a running job's: never evicted
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str, what: str = MAX_ENV) -> int | None:
    """Bytes of a size such as `16G`, `500M`, `1.5G` or `123456` (K, M, G, T: powers of 1024; a
    trailing `B`/`iB` is allowed); None for `none` (no cap). UsageError for anything else."""
    t = text.strip().upper()
    if t in ("NONE", "OFF", "UNLIMITED"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?", t)
    if m is None:
        raise UsageError(f"{what}={text!r} is not a size; give bytes with an optional K, M, G or T (e.g. 16G or 500M), "
                         "or `none` for no cap")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def cache_cap(environ=os.environ) -> int | None:
    """The node cache's cap in bytes (None: no cap), as the module docstring says."""
    text = environ.get(MAX_ENV, "").strip()
    if text:
        return parse_size(text)
    try:
        root = slice_cache.slices_dir()
        while not root.exists() and root != root.parent:
            root = root.parent
        disk = shutil.disk_usage(root).total
    except OSError:
        return DEFAULT_MAX
    return min(DEFAULT_MAX, disk // DEFAULT_DISK_SHARE)


def describe_cap(cap: int | None) -> str:
    """'a cap of 16 GiB' (in the units the variable is written in), or 'no cap'."""
    if cap is None:
        return "no cap"
    for unit in ("T", "G", "M", "K"):
        if cap >= _UNITS[unit]:
            return f"a cap of {cap / _UNITS[unit]:.3g} {unit}iB"
    return f"a cap of {cap} bytes"


def make_room(size: int, keep: Iterable[Path] = (), cap: int | None = -1) -> list[slice_cache.CachedSlice]:
    """Remove the least recently used cached files until `size` more bytes fit under the cap; never
    one of `keep` nor one used in the last RECENT_S seconds. Returns the files removed."""
    cap = cache_cap() if cap == -1 else cap
    if cap is None:
        return []
    entries = slice_cache.list_cached()
    total = sum(e.size for e in entries) + slice_cache.partial_bytes()
    keep = {Path(p).resolve() for p in keep}
    recent = time.time() - RECENT_S
    removed = []
    for e in sorted(entries, key=lambda e: e.last_used):
        if total + size <= cap:
            break
        if e.path.resolve() in keep or e.last_used > recent:
            continue
        with contextlib.suppress(OSError):
            slice_cache.remove(e.path)
            total -= e.size
            removed.append(e)
    return removed


def drop_included(new: slice_cache.CachedSlice, keep: Iterable[Path] = ()) -> list[slice_cache.CachedSlice]:
    """Remove the cached files of the same model that `new` includes: every slice once a whole copy
    is cached, else the slices whose layers lie within new's. Returns the files removed."""
    keep = {Path(p).resolve() for p in keep} | {new.path.resolve()}
    removed = []
    for e in slice_cache.list_cached():
        if e.model_sha256 != new.model_sha256 or e.path.resolve() in keep or e.layers is None:
            continue
        if new.layers is None or (new.layers[0] <= e.layers[0] and e.layers[1] <= new.layers[1]):
            with contextlib.suppress(OSError):
                slice_cache.remove(e.path)
                removed.append(e)
    return removed
