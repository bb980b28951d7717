"""Starting the job: detect an external MPI launcher, or re-execute under `mpiexec -n R`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from ..errors import UsageError

# Variables that MPICH/Hydra, Open MPI, Slurm and PMIx set in every rank of a job.
_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "PMI_FD")
RELAUNCHED = "PIPEINFER_RELAUNCHED"


def under_mpi_launcher() -> bool:
    if os.environ.get(RELAUNCHED):
        return True
    if any(k in os.environ for k in _MPI_ENV):
        return True
    return "SLURM_STEP_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def find_mpiexec() -> str:
    """The mpiexec of the mpich wheel next to this Python, else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise UsageError("no mpiexec found; install the mpich wheel (`pip install mpich`) or a system MPI, or run with --ranks 1")
    return found


def relaunch(n_ranks: int, argv: list[str]) -> int:
    """Run this same command as an MPI job of n_ranks processes and return its exit code."""
    cmd = [find_mpiexec(), "-n", str(n_ranks), sys.executable, "-m", "pipeinfer_cli", *argv]
    env = {**os.environ, RELAUNCHED: "1"}
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            return 130
