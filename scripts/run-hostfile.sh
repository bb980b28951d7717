#!/usr/bin/env bash
# Run `pipeinfer generate` across the hosts of a hostfile with mpirun: one rank per slot, and the
# world size decides the number of ranks (do not pass --ranks).
#
# Usage:  scripts/run-hostfile.sh HOSTFILE NRANKS GENERATE-ARGS...
#   scripts/run-hostfile.sh scripts/hostfile.example 4 qwen-coder --mode pipeinfer --threads 8 \
#       --chat "Write FizzBuzz in Python" -n 64
#   echo localhost:2 > /tmp/hosts && scripts/run-hostfile.sh /tmp/hosts 2 smollm2-135m-instruct -p "Hello" -n 16
#
# Every host needs passwordless ssh from this one and this checkout with its .venv at the same path
# (or PIPEINFER=/path/to/pipeinfer). The models need to be on the first host only (rank 0, the
# head): it streams every other rank its weights while the job loads, and each node keeps them in
# its node cache for the next job (docs/cluster.md, "Weights from the head"). Nothing is
# downloaded under mpirun: pull the models on the first host beforehand (`pipeinfer models pull NAME`).
# --layer-split auto and -M auto need a profile of these ranks (the ranks of a job cannot
# calibrate): run this script's mpirun with `pipeinfer calibrate MODEL --quick --out FILE` first,
# FILE where every host sees it, then pass --profile FILE.
# Extra launcher options go in MPIRUN_ARGS (several words, split on spaces).
#
# On the emulated cluster (docs/emulated-cluster.md), as root: its hostfile and the environment that
# sends the ranks to its hosts come from `emulate-cluster.sh exec`:
#   scripts/emulate-cluster.sh up 2 --rate 1gbit --cpus 1
#   scripts/emulate-cluster.sh exec -- scripts/run-hostfile.sh /run/pipeinfer-emulate-cluster/pi-emu/hostfile 2 \
#       smollm2-135m-instruct -p "Hello" -n 16
#   scripts/emulate-cluster.sh down
#
# Which MPI:
# - Default: the mpich wheel in .venv (installed with pipeinfer). Its mpirun (Hydra) starts the
#   ranks over ssh and talks TCP: enough for Ethernet clusters and for trying this on one machine.
#   Hostfile lines are HOST:SLOTS (see scripts/hostfile.example); Hydra refuses "HOST slots=N".
#   Hydra passes this shell's whole environment to every rank; MPIRUN_ARGS="-genv VAR value" sets one.
# - A system MPI (Open MPI, Intel MPI, Cray MPICH, MVAPICH) for InfiniBand/Slingshot: set
#   MPIRUN=mpirun (that MPI's launcher) and make mpi4py load that library, not the wheel's
#   (the same two commands as in docs/cluster.md):
#       .venv/bin/pip uninstall -y mpich mpi4py
#       MPI4PY_BUILD_MPICC="$(command -v mpicc)" .venv/bin/pip install --no-cache-dir --no-binary=mpi4py "mpi4py>=4,<5"
#   Check: $MPIRUN -n 2 .venv/bin/python -m mpi4py.bench helloworld   (each rank says "of 2").
#   Open MPI's hostfile lines are "HOST slots=N", and it passes no environment variables unless
#   told: MPIRUN_ARGS="-x PIPEINFER_CACHE" (the value of this shell) or "-x VAR=value".
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
if [ -z "${MPIRUN:-}" ]; then
    MPIRUN=$root/.venv/bin/mpirun
    # The bundled Hydra launcher stops with "token slots not supported at this time" otherwise.
    if grep -Eq '^[^#]*slots[[:space:]]*=' "$hostfile"; then
        echo "Error: $hostfile uses Open MPI's 'HOST slots=N' lines; the bundled mpirun (MPICH Hydra) wants 'HOST:N'" \
             "(or set MPIRUN to Open MPI's mpirun)" >&2
        exit 2
    fi
fi
# shellcheck disable=SC2086  # MPIRUN_ARGS holds several words on purpose
exec "$MPIRUN" -hostfile "$hostfile" -n "$n_ranks" ${MPIRUN_ARGS:-} "$PIPEINFER" generate "$@"
