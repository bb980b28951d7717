"""The emulated cluster: N hosts on one machine (network namespaces joined by rate-limited links, each
with its own hostname and, with --cpus/--mem, its own cgroups), on which `pipeinfer` jobs run one rank
per host over TCP. The command is scripts/emulate-cluster.sh (cluster/cli.py); the benchmarks use
`Cluster` through benchmarks/emulated.py.
"""
