"""Hung ranks (--rank-timeout): a rank that stops answering ends the job with one error naming it.

- A stage stopped with SIGSTOP in the middle of a `--ranks 2` generation: the head notices that it
  sent nothing (not even a heartbeat) and names it; every process of the job ends.
- The head stopped: the other ranks notice, rank 1 says so, and the job ends.
- A stage stuck in a compute (PIPEINFER_DEBUG_FAULT …:stall: its heartbeats go on, its progress
  does not): named as making no progress.
- A stage that computes slowly but steadily is not a hang: a compute slowed far past the timeout by
  SIGSTOP/SIGCONT bursts shorter than it still ends with the right text.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobprocs import finish_job, marked_pids, start_job, wait_first_output

pytestmark = pytest.mark.mpi

TIMEOUT_S = 3  # --rank-timeout in these tests: the hang is noticed this soon (the default is 60 s)
LONG_JOB = ["-p", "The quick brown fox", "-n", 3000, "--ctx", 4096, "--threads", 1]


def cli(model: Path, *args) -> list[str]:
    return [sys.executable, "-m", "pipeinfer_cli", "generate", str(model), *map(str, LONG_JOB), *map(str, args)]


def rank_pid(marker: str, rank: int) -> int:
    want = f"PMI_RANK={rank}\0".encode()
    pids = [p for p in marked_pids(marker) if want in Path(f"/proc/{p}/environ").read_bytes()]
    assert len(pids) == 1, pids
    return pids[0]


def finish(proc: subprocess.Popen, marker: str, within_s: float = 60) -> tuple[int, str, str]:
    return finish_job(proc, marker, within_s, "the job still ran {s} s after the rank stopped: a hang")


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    from tinygguf import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("hung") / "target.gguf", arch="qwen2", n_layer=4, seed=0)


def test_a_stopped_stage_is_named(tiny_target):
    proc, marker = start_job(cli(tiny_target, "--ranks", 2, "--rank-timeout", TIMEOUT_S))
    wait_first_output(proc)
    os.kill(rank_pid(marker, 1), signal.SIGSTOP)
    rc, _, err = finish(proc, marker)
    assert rc == 1
    line = one_error_line(err)
    assert re.match(rf"Error: rank 1 \(stage 2 of 2, host \S+\) sent nothing for {TIMEOUT_S} s while a run was in "
                    r"flight; it may be hung, stopped or overloaded \(raise --rank-timeout", line), line


def test_a_stopped_head_ends_the_job(tiny_target):
    proc, marker = start_job(cli(tiny_target, "--ranks", 3, "--rank-timeout", TIMEOUT_S))
    wait_first_output(proc)
    os.kill(rank_pid(marker, 0), signal.SIGSTOP)
    rc, _, err = finish(proc, marker)
    assert rc != 0
    line = one_error_line(err)
    assert re.match(rf"Error: rank 0 \(the head, stage 1 of 3, host \S+\) sent nothing for {TIMEOUT_S} s", line), line


def test_a_stage_stuck_in_compute_is_named(tiny_target):
    proc, marker = start_job(cli(tiny_target, "--ranks", 3, "--rank-timeout", TIMEOUT_S),
                             PIPEINFER_DEBUG_FAULT="1:payload:20:stall")
    wait_first_output(proc)
    rc, _, err = finish(proc, marker)
    assert rc == 1
    line = one_error_line(err)
    assert re.match(rf"Error: rank 1 \(stage 2 of 3, host \S+\) made no progress in its compute for {TIMEOUT_S} s",
                    line), line


def test_short_pauses_are_not_a_hang(tiny_target):
    """A rank paused again and again, each time for less than the timeout, is slow, not hung."""
    args = ["-p", "The quick brown fox", "-n", 64, "--ctx", 512, "--threads", 1]
    want = subprocess.run([sys.executable, "-m", "pipeinfer_cli", "generate", str(tiny_target), *map(str, args)],
                          capture_output=True, timeout=120)
    assert want.returncode == 0, want.stderr
    proc, marker = start_job([sys.executable, "-m", "pipeinfer_cli", "generate", str(tiny_target), *map(str, args),
                              "--ranks", "2", "--rank-timeout", "4"])
    first = wait_first_output(proc)
    pid = rank_pid(marker, 1)
    for _ in range(3):  # 3 pauses of 1.5 s, well under the 4 s timeout
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(1.5)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            break  # the job finished meanwhile
        time.sleep(0.3)
    rc, out, err = finish(proc, marker)
    assert rc == 0, err
    assert (first.decode() + out) == want.stdout.decode()
