#!/bin/sh
# An emulated cluster on one machine (root): N network namespaces with their own hostnames, joined
# by rate-limited veth links to a bridge; MPI jobs run one rank per namespace over TCP.
# Bandwidth is emulated, latency is not (no netem here). See scripts/emulate_cluster.py or --help.
#   scripts/emulate-cluster.sh run 2 --rate 100mbit -- smollm2-135m-instruct -p "Hello" -n 16
#   scripts/emulate-cluster.sh up 3 --rate 10mbit
#   scripts/emulate-cluster.sh exec -- .venv/bin/pipeinfer generate smollm2-135m-instruct --ranks 3 -p Hi
#   scripts/emulate-cluster.sh down
root=$(cd "$(dirname "$0")/.." && pwd)
python=$root/.venv/bin/python
[ -x "$python" ] || python=python3
exec "$python" "$root/scripts/emulate_cluster.py" "$@"
