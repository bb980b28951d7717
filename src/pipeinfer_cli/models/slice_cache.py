"""The node cache of streamed weights: rank slices and whole files a rank was sent by the head.

Files live in `<cache>/slices/`, named by the model's sha256 and what part of it they hold
(`<sha256>.layers-14-27.gguf`, or `<sha256>.whole.gguf` for a whole draft file), each with a
`.json` beside it: the model's label, the part, the size and the file's own sha256. A cached file
is used only when its bytes still hash to that digest (a flipped byte makes it fetched again).
Files are written under a `.partial` name and renamed once complete and checked, so a job cut
in the middle never leaves a file that a later job would use; `models prune` removes leftovers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import CacheError
from .cache import cache_dir, ensure_writable_cache, probe_write
from .fetch import current_umask, sha256_file

SLICES_DIR = "slices"
PARTIAL = ".partial"
WHOLE = "whole"


def slices_dir() -> Path:
    return cache_dir() / SLICES_DIR


def part_name(layers: tuple[int, int] | None) -> str:
    """'layers-14-27' for layers [14, 28), 'whole' for a whole file."""
    return WHOLE if layers is None else f"layers-{layers[0]}-{layers[1] - 1}"


def slice_path(model_sha256: str, layers: tuple[int, int] | None) -> Path:
    return slices_dir() / f"{model_sha256}.{part_name(layers)}.gguf"


@dataclass(frozen=True)
class CachedSlice:
    path: Path
    model: str  # the model's label when it was streamed
    model_sha256: str
    layers: tuple[int, int] | None  # [begin, end), or None for a whole file
    size: int
    sha256: str  # of this file's bytes
    created: float  # Unix time
    last_used: float = 0.0  # Unix time a job last used it (its record's mtime)

    def describe(self) -> str:
        return "whole file" if self.layers is None else f"layers {self.layers[0]}-{self.layers[1] - 1}"


def _sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


def read_entry(path: Path) -> CachedSlice | None:
    """A cached file's record, or None when the file or its record is missing or unreadable."""
    try:
        rec = json.loads(_sidecar(path).read_text())
        layers = tuple(rec["layers"]) if rec.get("layers") is not None else None
        return CachedSlice(path, str(rec["model"]), str(rec["model_sha256"]), layers, int(rec["size"]),
                           str(rec["sha256"]), float(rec.get("created", 0)), _sidecar(path).stat().st_mtime)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def lookup(model_sha256: str, layers: tuple[int, int] | None) -> tuple[Path | None, str | None]:
    """(path, None) for a cached file whose bytes check out; (None, why) for one that does not
    (it is removed, so it is fetched again); (None, None) when there is none."""
    path = slice_path(model_sha256, layers)
    if not path.exists():
        return None, None
    entry = read_entry(path)
    why = None
    if entry is None:
        why = "its record is missing or unreadable"
    elif path.stat().st_size != entry.size:
        why = f"it has {path.stat().st_size} bytes, its record says {entry.size}"
    elif sha256_file(path) != entry.sha256:
        why = "its bytes no longer match their sha256 (corrupted)"
    if why is None:
        touch(path)
        return path, None
    try:
        remove(path)
    except OSError as e:
        why += f" (and it could not be removed: {(e.strerror or str(e)).lower()})"
    return None, f"the cached {path.name} was not used: {why}; it is fetched again"


def touch(path: Path) -> None:
    """Record a cached file's use now (its record's mtime: `models prune --unused-days`, and the node
    cache's cap, which removes the least recently used first)."""
    with contextlib.suppress(OSError):  # a read-only cache still serves; only the last use goes unrecorded
        os.utime(_sidecar(path))


def remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    _sidecar(path).unlink(missing_ok=True)


def list_cached() -> list[CachedSlice]:
    """Every complete cached file (with or without a readable record: a lone file is listed with
    what its name says, so that `models prune` can remove it)."""
    root = slices_dir()
    if not root.is_dir():
        return []
    out = []
    for path in sorted(root.glob("*.gguf")):
        entry = read_entry(path)
        if entry is None:
            sha, _, part = path.stem.partition(".")
            st = path.stat()
            entry = CachedSlice(path, "?", sha, None, st.st_size, "", st.st_mtime, st.st_mtime)
        out.append(entry)
    return out


ORPHAN_AGE_S = 3600.0  # a record without its file, or a partial file of another host, this old is a leftover


def leftovers(only_dead: bool = False, unused_since: float | None = None) -> list[Path]:
    """Files of jobs that were cut: partial files whose writer has ended (on this host; on another
    host, once ORPHAN_AGE_S old), and records without their file (as old). A file that a running job
    is still writing is never one. only_dead: partial files of this host's ended writers only.
    unused_since: a Unix time; only files last written before it (`models prune --unused-days`)."""
    root = slices_dir()
    if not root.is_dir():
        return []
    old = time.time() - ORPHAN_AGE_S
    stray = []
    for p in root.iterdir():
        try:
            mtime = p.stat().st_mtime
        except OSError:  # removed meanwhile (its writer committed or cleaned up)
            continue
        if unused_since is not None and mtime >= unused_since:
            continue
        if PARTIAL in p.name:
            ended = _writer_ended(p)
            if ended or (ended is None and not only_dead and mtime < old):
                stray.append(p)
        elif not only_dead and p.suffix == ".json" and not p.with_suffix(".gguf").exists() and mtime < old:
            stray.append(p)
    return sorted(stray)


@dataclass(frozen=True)
class PartialFile:
    path: Path
    size: int
    modified: float  # Unix time of its last write
    writing: bool | None  # its writer is running (True), has ended (False), cannot be told (None: another host's)

    def to_dict(self) -> dict:
        return {"path": str(self.path), "size": self.size, "modified": self.modified, "writing": self.writing}


def partial_files() -> list[PartialFile]:
    """Every partial file of the node cache: streams under way, or left by cut jobs."""
    root = slices_dir()
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.iterdir()):
        if PARTIAL not in p.name:
            continue
        try:
            st = p.stat()
        except OSError:
            continue
        ended = _writer_ended(p)
        out.append(PartialFile(p, st.st_size, st.st_mtime, None if ended is None else not ended))
    return out


def _writer_ended(partial: Path) -> bool | None:
    """Whether the process that writes this partial file (named .<file>~<host>~<pid>.partial) has
    ended; None when it cannot be told (another host's, or a name of another form)."""
    parts = partial.name[: -len(PARTIAL)].split("~")
    if len(parts) != 3 or parts[1] != socket.gethostname() or not parts[2].isdigit():
        return None
    return not Path(f"/proc/{parts[2]}").exists()


def partial_bytes() -> int:
    """Bytes in partial files (streams under way, or left by cut jobs)."""
    return sum(p.size for p in partial_files())


def remove_dead_partials() -> list[tuple[str, int]]:
    """Best effort, when a rank starts: remove the partial files that cut jobs of this host left
    (a writer killed by SIGKILL cannot remove its own). Returns (name, bytes) of each one removed."""
    removed = []
    for path in leftovers(only_dead=True):
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:  # another rank of this host removed it first
            continue
        removed.append((path.name, size))
    return removed


def total_bytes() -> int:
    return sum(e.size for e in list_cached())


def check_writable() -> None:
    """CacheError (one line, with the fix) unless the node cache can take a streamed file: checked
    before a rank asks the head for its weights, so that the head starts no stream the rank cannot keep."""
    ensure_writable_cache()
    try:  # the cache root may be writable and its slices/ not (made by another user, say)
        slices_dir().mkdir(parents=True, exist_ok=True)
        probe_write(slices_dir())
    except OSError as e:
        raise _unwritable(e) from None


def _unwritable(e: OSError) -> CacheError:
    return CacheError(f"cannot write the weights this rank is sent into the node cache {slices_dir()}: "
                      f"{(e.strerror or str(e)).lower()}; fix its permissions or set PIPEINFER_CACHE to "
                      "a writable directory")


class SliceWriter:
    """Writes one streamed file: bytes appended in order under a partial name, hashed as they
    come; commit() checks the digest the head sent, records it and renames the file into place.
    Leaving the `with` block without commit() removes the partial file."""

    def __init__(self, model: str, model_sha256: str, layers: tuple[int, int] | None, size: int):
        check_writable()
        self.model, self.model_sha256, self.layers, self.size = model, model_sha256, layers, size
        self.final = slice_path(model_sha256, layers)
        self.tmp = self.final.with_name(f".{self.final.name}~{socket.gethostname()}~{os.getpid()}{PARTIAL}")
        try:
            remove_dead_partials()
            self._f = open(self.tmp, "wb")
        except OSError as e:
            raise _unwritable(e) from None
        self._digest = hashlib.sha256()
        self.written = 0

    def write(self, block) -> None:
        self._f.write(block)
        self._digest.update(block)
        self.written += len(block)

    def commit(self, expected_sha256: str) -> Path:
        got = self._digest.hexdigest()
        if self.written != self.size or got != expected_sha256:
            raise OSError(f"the streamed {part_name(self.layers)} of {self.model} arrived damaged "
                          f"({self.written} of {self.size} bytes, sha256 {got[:12]}… instead of {expected_sha256[:12]}…)")
        self._f.flush()
        os.fsync(self._f.fileno())
        os.fchmod(self._f.fileno(), 0o666 & ~current_umask())
        self._f.close()
        record = {"model": self.model, "model_sha256": self.model_sha256,
                  "layers": list(self.layers) if self.layers is not None else None,
                  "size": self.size, "sha256": got, "created": time.time()}
        side = _sidecar(self.final)
        side_tmp = side.with_name(f".{side.name}~{socket.gethostname()}~{os.getpid()}{PARTIAL}")
        if not self.tmp.exists():
            raise OSError(f"the partial file {self.tmp.name} was removed while it was written (by `pipeinfer models "
                          "prune` or by hand); run the job again")
        side_tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(side_tmp, side)
        os.replace(self.tmp, self.final)
        return self.final

    def __enter__(self) -> SliceWriter:
        return self

    def __exit__(self, *exc) -> None:
        if not self._f.closed:
            self._f.close()
        self.tmp.unlink(missing_ok=True)
