"""MPI transport: wire messages, polling without spinning, and launching under mpiexec."""
