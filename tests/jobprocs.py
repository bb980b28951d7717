"""Real job processes in tests: mark every process of a job (mpiexec, launcher, proxies, ranks) with
an environment variable, start it in its own session, wait for its first output, and make sure
nothing of it survives."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

MARKER_ENV = "PIPEINFER_TEST_MARKER"  # inherited by mpiexec, the launcher, its proxies and every rank


def job_env(marker: str, **extra: str) -> dict[str, str]:
    """This environment without launcher or pipeinfer settings (the model cache kept), plus the marker."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIPEINFER_", "PMI_", "OMPI_", "PMIX_", "HYDRA_"))}
    if "PIPEINFER_CACHE" in os.environ:
        env["PIPEINFER_CACHE"] = os.environ["PIPEINFER_CACHE"]
    env.update({MARKER_ENV: marker, **extra})
    return env


def marked_pids(marker: str) -> list[int]:
    """Live processes (any depth) that carry this job's marker."""
    needle = f"{MARKER_ENV}={marker}\0".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if needle in Path(f"/proc/{entry}/environ").read_bytes() and \
                    Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def rank_process(marker: str, rank: int) -> int:
    """The pid of an MPI rank's own process in a marked job: not its start watchdog, which carries
    the rank's variables too."""
    want = f"PMI_RANK={rank}\0".encode()
    found = [p for p in marked_pids(marker)
             if want in _read(f"/proc/{p}/environ") and _read(f"/proc/{p}/comm").strip() not in
             (b"pipeinfer-start",)]
    assert len(found) == 1, f"rank {rank}: {found}"
    return found[0]


def zombie_children(marker: str) -> list[tuple[int, str]]:
    """(pid, name) of every zombie whose parent is a process of the job: a child it never reaped."""
    parents = set(marked_pids(marker))
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read(f"/proc/{entry}/stat").decode(errors="replace")
            name, _, rest = stat.rpartition(")")
            fields = rest.split()
            if len(fields) > 1 and fields[0] == "Z" and int(fields[1]) in parents:
                found.append((int(entry), name.partition("(")[2]))
    return found


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def assert_no_survivors(marker: str, grace_s: float = 5.0) -> None:
    deadline = time.monotonic() + grace_s
    while (left := marked_pids(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:  # do not leak them into the rest of the session
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"processes of the job still running: {left}"


def start_job(cmd: list, **env: str) -> tuple[subprocess.Popen, str]:
    """Start a marked job in its own session (as from a terminal); return (process, marker)."""
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=job_env(marker, **env), start_new_session=True)
    return proc, marker


def wait_first_output(proc: subprocess.Popen, timeout: float = 60) -> bytes:
    """Block until the job prints its first bytes (the models are loaded and decoding started)."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the job printed nothing within the load timeout")
    first = os.read(proc.stdout.fileno(), 1 << 16)
    assert first, "the job ended before it printed a token"
    return first


def finish_job(proc: subprocess.Popen, marker: str, within_s: float,
               hang: str = "the job did not end within {s} s") -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a marked job; still running after within_s seconds is the
    failure (`hang`, with {s} for the seconds). Either way nothing of the job may survive."""
    try:
        out, err = proc.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        assert_no_survivors(marker)
        pytest.fail(hang.format(s=within_s))
    assert_no_survivors(marker)
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")
