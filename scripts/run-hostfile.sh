#!/usr/bin/env bash
# Run `pipeinfer generate` across the hosts of a hostfile with mpirun: one rank per slot, and the
# world size decides the number of ranks (do not pass --ranks).
#
# Usage:  scripts/run-hostfile.sh HOSTFILE NRANKS GENERATE-ARGS...
#   scripts/run-hostfile.sh scripts/hostfile.example 4 qwen-coder --layer-split 0.2,0.4,0.4/1 \
#       --mode speculative --chat "Write FizzBuzz in Python" -n 64
#   echo localhost:2 > /tmp/hosts && scripts/run-hostfile.sh /tmp/hosts 2 smollm2-135m-instruct -p "Hello" -n 16
#
# Every host needs passwordless ssh from this one, this checkout and its .venv at the same path
# (or PIPEINFER=/path/to/pipeinfer), and the models already in its cache: under mpirun nothing is
# downloaded, so run `pipeinfer models pull NAME` on each host or share PIPEINFER_CACHE.
#
# Which MPI:
# - Default: the mpich wheel in .venv (installed with pipeinfer). Its mpirun (Hydra) starts the
#   ranks over ssh and talks TCP: enough for Ethernet clusters and for trying this on one machine.
# - A system MPI (Open MPI, Intel MPI, Cray MPICH, MVAPICH) for InfiniBand/Slingshot: set
#   MPIRUN=mpirun (that MPI's launcher) and make mpi4py load that library, not the wheel's:
#       .venv/bin/pip uninstall -y mpich
#       env MPICC="$(command -v mpicc)" MPI4PY_BUILD_MPICC="$(command -v mpicc)" \
#           .venv/bin/pip install --force-reinstall --no-cache-dir --no-binary=mpi4py "mpi4py>=4,<5"
#   Check: $MPIRUN -n 2 .venv/bin/python -m mpi4py.bench helloworld   (each rank says "of 2").
#   Open MPI does not forward the environment by default: add e.g. MPIRUN_ARGS="-x PIPEINFER_CACHE".
set -euo pipefail

if [ $# -lt 3 ]; then
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
hostfile=$1 n_ranks=$2
shift 2
[ -r "$hostfile" ] || { echo "Error: cannot read the hostfile $hostfile" >&2; exit 2; }

root=$(cd "$(dirname "$0")/.." && pwd)
PIPEINFER=${PIPEINFER:-$root/.venv/bin/pipeinfer}
MPIRUN=${MPIRUN:-$root/.venv/bin/mpirun}
# shellcheck disable=SC2086  # MPIRUN_ARGS holds several words on purpose
exec "$MPIRUN" -hostfile "$hostfile" -n "$n_ranks" ${MPIRUN_ARGS:-} "$PIPEINFER" generate "$@"
