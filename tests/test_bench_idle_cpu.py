"""benchmarks/idle_cpu.py: reading a process's CPU and context switches (no server needed)."""

from __future__ import annotations


def test_idle_cpu_reads_a_process_cpu_and_switches_from_proc():
    import os
    import time

    import benchmarks.idle_cpu as idle

    cpu0, sw0 = idle.process_cpu(os.getpid())
    t = time.process_time()
    while time.process_time() - t < 0.1:  # burn CPU
        pass
    for _ in range(20):
        time.sleep(0.001)  # and switch
    cpu1, sw1 = idle.process_cpu(os.getpid())
    assert cpu1 - cpu0 >= 0.05
    assert sw1 - sw0 >= 20
