"""A job command stopped while it calibrates its ranks (`--layer-split auto` without a profile runs
`calibrate --quick` first): every process of the calibration's MPI job ends, its shared memory
goes, and the command says so in one line (SmolLM2 on 3 ranks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from jobprocs import job_env, marked_pids

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not Path("/proc/self/environ").exists() or not Path("/dev/shm").is_dir(),
                                 reason="Linux: reads /proc")]


def _calibrating_ranks(marker: str) -> list[int]:
    found = []
    for pid in marked_pids(marker):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"PMI_RANK=" in env and b"calibrate" in cmd:
            found.append(pid)
    return found


def _shm_of(pids: list[int]) -> set[Path]:
    """MPICH's shared-memory files these processes map."""
    files = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        files |= {Path(line.split(None, 5)[5].strip()) for line in maps.splitlines()
                  if "/dev/shm/mpich_" in line and not line.rstrip().endswith("(deleted)")}
    return files


@pytest.mark.parametrize("how", ["command", "group"])
def test_a_stop_during_the_implicit_calibration_ends_every_process(smollm2_path, tmp_path, how):
    """how: SIGTERM to the command alone (`kill PID`, or a wrapper that passes it on), or to its
    whole process group (`timeout`). Before, the calibration ran on, with its job, after the
    command had died."""
    marker = uuid.uuid4().hex
    env = job_env(marker, PIPEINFER_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "pipeinfer_cli", "generate", str(smollm2_path), "--ranks", "3", "--layer-split",
           "auto", "--threads", "1", "-p", "Hi", "-n", "4"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    shm: set[Path] = set()
    try:
        deadline = time.monotonic() + 90
        while len(ranks := _calibrating_ranks(marker)) < 3:
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        # Wait until the ranks have started MPI and mapped its shared memory (seconds on a loaded box).
        while not (shm := _shm_of(marked_pids(marker))):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.1)
        time.sleep(0.5)  # the other ranks map theirs too
        shm = _shm_of(marked_pids(marker))
        assert ranks and shm
        if how == "group":
            os.killpg(p.pid, signal.SIGTERM)
        else:
            os.kill(p.pid, signal.SIGTERM)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.5)  # a process the command ended may still be a zombie of another
        left = marked_pids(marker)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    out, err = p.communicate(timeout=30)
    assert left == []  # nothing of the calibration's job outlives the command
    assert [f for f in shm if f.exists()] == []
    lines = err.decode().splitlines()
    assert p.returncode == 128 + signal.SIGTERM, err.decode()
    assert lines[-1] == "Error: stopped by SIGTERM" and lines.count("Error: stopped by SIGTERM") == 1, lines
    assert not list((tmp_path / "cache").glob("profiles/*.json"))  # no profile of a cut calibration
