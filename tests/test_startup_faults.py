"""A rank that fails before the job starts ends the whole job, with one `Error:` line naming it.

Real `mpiexec` jobs whose ranks differ (MPMD: `mpiexec -n 1 A : -n 1 B`), as on a cluster where
one node lacks the model or sees another option: the job ends promptly, the error is printed once
by the head with the failing rank and its host, no process survives, and the head does not burn
its core while it waits for a rank that is late.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from jobprocs import finish_job, marked_pids, start_job

pytestmark = pytest.mark.mpi

BIN = Path(sys.executable).parent
MPIEXEC, PIPEINFER = str(BIN / "mpiexec"), str(BIN / "pipeinfer")
MODEL = "smollm2-135m-instruct"
ARGS = ["generate", MODEL, "-p", "Hi", "-n", "4", "--threads", "1"]


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_late_node_without_the_model_is_waited_for_and_sent_its_layers(smollm2_path, tmp_path):
    """Rank 1's cache lacks the model, and rank 1 starts 4 s late: the head waits without spinning,
    then sends rank 1 its layers (runtime/weight_stream.py) and the job runs."""
    cache, empty = str(smollm2_path.parent), tmp_path / "empty-cache"
    empty.mkdir()
    late = tmp_path / "late.sh"
    late.write_text(f"#!/bin/sh\nsleep 4\nexec {PIPEINFER} \"$@\"\n")
    late.chmod(0o755)
    proc, marker = start_job([MPIEXEC, "-n", 1, "-env", "PIPEINFER_CACHE", cache, PIPEINFER, *ARGS, ":",
                              "-n", 1, "-env", "PIPEINFER_CACHE", str(empty), str(late), *ARGS])
    time.sleep(3.0)
    heads = [p for p in marked_pids(marker) if b"PMI_RANK=0\0" in Path(f"/proc/{p}/environ").read_bytes()
             and b"pipeinfer" in Path(f"/proc/{p}/cmdline").read_bytes()]
    used = {p: cpu_seconds(p) for p in heads}
    time.sleep(1.0)
    # Over that second the head only waits (in MPI_Init or its check-in): it must sleep, not spin.
    assert heads and all(cpu_seconds(p) - used[p] < 0.3 for p in heads), [cpu_seconds(p) - used[p] for p in heads]
    rc, out, err = finish_job(proc, marker, within_s=60)
    assert rc == 0 and out.strip(), err
    assert f"rank 1 (host {socket.gethostname()}) has no copy of {MODEL}" in err


def test_a_model_missing_on_the_head_is_one_line_naming_it_and_the_host(smollm2_path, tmp_path):
    """The head is the one node that needs the model: without it the job ends at once, saying so."""
    empty = tmp_path / "empty-cache"
    empty.mkdir()
    proc, marker = start_job([MPIEXEC, "-n", 1, "-env", "PIPEINFER_CACHE", str(empty), PIPEINFER, *ARGS, "--no-pull",
                              ":", "-n", 1, "-env", "PIPEINFER_CACHE", str(smollm2_path.parent), PIPEINFER, *ARGS])
    rc, out, err = finish_job(proc, marker, within_s=60)
    assert rc != 0 and out == ""
    line = one_error_line(err)
    assert line.startswith(f"Error: model '{MODEL}' is not on the head's host ({socket.gethostname()})"), line


def test_an_option_only_one_rank_rejects(smollm2_path):
    proc, marker = start_job([MPIEXEC, "-n", 1, PIPEINFER, *ARGS, ":", "-n", 1, PIPEINFER, *ARGS, "--temp", "-1"],
                             PIPEINFER_CACHE=str(smollm2_path.parent))
    rc, out, err = finish_job(proc, marker, within_s=60)
    line = one_error_line(err)
    assert line.startswith("Error: rank 1 (host ") and "--temp" in line, line
    assert rc == 2  # a usage error on any rank exits as one


def test_an_error_every_rank_meets_is_printed_once(smollm2_path):
    proc, marker = start_job([MPIEXEC, "-n", 2, PIPEINFER, *ARGS, "--ranks", 3], PIPEINFER_CACHE=str(smollm2_path.parent))
    rc, out, err = finish_job(proc, marker, within_s=60)
    assert one_error_line(err) == "Error: the MPI job has 2 ranks but the options ask for 3; start it with -n 3"
    assert rc == 2


def test_a_rank_that_never_starts_mpi_ends_the_job(smollm2_path):
    """Rank 1 exits before MPI starts: MPICH's launcher would wait for ever, with rank 0 inside
    MPI_Init. The start watchdog ends the job after PIPEINFER_START_TIMEOUT (+15 s) with one line."""
    proc, marker = start_job([MPIEXEC, "-n", 1, PIPEINFER, *ARGS, ":", "-n", 1, "sh", "-c", "exit 3"],
                             PIPEINFER_CACHE=str(smollm2_path.parent), PIPEINFER_START_TIMEOUT="2")
    rc, out, err = finish_job(proc, marker, within_s=90)
    assert rc != 0
    errors = [ln for ln in err.splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1 and "did not start within 17 s" in errors[0], err


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_context_too_large_for_memory_is_one_line(smollm2_path, ranks):
    """ggml's allocator logs its failure; only the job's own line reaches the user."""
    proc, marker = start_job([PIPEINFER, *ARGS, "--ctx", 10_000_000, "--ranks", ranks],
                             PIPEINFER_CACHE=str(smollm2_path.parent))
    rc, out, err = finish_job(proc, marker, within_s=60)
    assert one_error_line(err).startswith("Error: --ctx 10000000 is too large for this machine's memory")
    assert rc == 2
