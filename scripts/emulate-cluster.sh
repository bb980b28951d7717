#!/bin/sh
# An emulated cluster on one machine (root): N network namespaces with their own hostnames, joined
# by rate-limited veth links to a bridge; MPI jobs run one rank per namespace over TCP. Bandwidth is
# emulated, latency is not (no netem here). The code is in cluster/ (cluster/cli.py); see --help.
#   scripts/emulate-cluster.sh run 2 --rate 100mbit -- smollm2-135m-instruct -p "Hello" -n 16
#   scripts/emulate-cluster.sh up 3 --rate 10mbit
#   scripts/emulate-cluster.sh exec -- .venv/bin/pipeinfer generate smollm2-135m-instruct --ranks 3 -p Hi
#   scripts/emulate-cluster.sh down
root=$(cd "$(dirname "$0")/.." && pwd)
python=$root/.venv/bin/python
[ -x "$python" ] || python=python3
# The checkout on the path of this Python only (not in PYTHONPATH, which the jobs would inherit).
exec "$python" -c 'import sys; sys.path.insert(0, sys.argv.pop(1)); from cluster.cli import main; sys.exit(main())' "$root" "$@"
