"""`python -m pipeinfer_cli …` is the `pipeinfer` command (used when relaunching under mpiexec)."""

from .cli.app import main

main()
