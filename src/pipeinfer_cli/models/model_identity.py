"""Which model file is which, across hosts: a file's identity on its host, and its sha256.

The head owns the job's models; another rank uses its own copy only when it is the same file
(ranks on the head's host see the same inode) or has the same size and sha256 (a copy on another
node). Hashing a large file takes seconds, so digests are remembered per (path, size, mtime) in
the cache directory; a registry model's digest is the registry's (its pull verified it).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from .cache import cache_dir
from .fetch import sha256_file

_DIGESTS_FILE = "digests.json"  # in the cache directory: {realpath: [size, mtime_ns, sha256]}


@dataclass(frozen=True)
class FileIdentity:
    """A model file as one host sees it (what a rank tells the head at start-up)."""

    host: str
    path: str  # resolved path
    size: int
    device: int
    inode: int
    mtime_ns: int
    sha256: str | None = None  # known without hashing (a registry model), else None

    def same_file(self, other: FileIdentity | None) -> bool:
        """The very same file (same host, device and inode, unchanged): no hashing needed."""
        return (other is not None and self.host == other.host and self.device == other.device
                and self.inode == other.inode and self.size == other.size and self.mtime_ns == other.mtime_ns)


def identify(path: Path | None, registry_sha256: str | None = None, registry_size: int | None = None) -> FileIdentity | None:
    """This host's identity of a model file, or None when there is no such file here."""
    if path is None:
        return None
    try:
        real = Path(path).resolve()
        st = real.stat()
    except OSError:
        return None
    if not real.is_file():
        return None
    known = registry_sha256 if registry_size is not None and st.st_size == registry_size else None
    return FileIdentity(socket.gethostname(), str(real), st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns, known)


def file_sha256(ident: FileIdentity, trust_registry: bool = True) -> str:
    """The file's sha256: the registry's, a remembered one, or hashed now (and remembered).
    trust_registry=False: the bytes' own digest even for a registry model (another rank's copy,
    which may have been damaged since its pull verified it)."""
    if ident.sha256 is not None and trust_registry:
        return ident.sha256
    memo = _load_digests()
    hit = memo.get(ident.path)
    if hit is not None and hit[0] == ident.size and hit[1] == ident.mtime_ns:
        return hit[2]
    digest = sha256_file(Path(ident.path))
    memo[ident.path] = [ident.size, ident.mtime_ns, digest]
    _store_digests(memo)
    return digest


def _load_digests() -> dict[str, list[int | str]]:
    """path -> [size, mtime_ns, sha256] of the files hashed before."""
    try:
        data = json.loads((cache_dir() / _DIGESTS_FILE).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store_digests(memo: dict[str, list[int | str]]) -> None:
    """Best effort: a cache that cannot be written only means hashing again next time."""
    root = cache_dir()
    tmp = root / f".{_DIGESTS_FILE}.{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, root / _DIGESTS_FILE)
    except OSError:
        tmp.unlink(missing_ok=True)
