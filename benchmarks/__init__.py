"""pipeinfer's benchmarks, run from the checkout as `python -m benchmarks.NAME` (the make targets
`bench-*` call them). Every benchmark launches its jobs through one runner (runner.py: a
`pipeinfer` command as a user types it, its --json read back), computes its figures with
figures.py, runs on emulated hosts through one fixture (emulated.py, over cluster/), and
publishes one table and JSON document through report.py, which names the machine's CPU.
"""
