"""The clock of calibrate's compute probes: a single-threaded probe is timed in the process's CPU
time over the rank's CPU share, so another process on the same cores (another emulated host of the
same machine) does not make the rank look slower; with more threads, wall time."""

from __future__ import annotations

import time

from pipeinfer_cli.runtime.calibrate_probes import ProbeSpec, probe_clock_share


def _spin(cpu_s: float) -> None:
    end = time.process_time() + cpu_s
    while time.process_time() < end:
        pass


def test_the_share_is_the_usable_cpus_of_a_single_threaded_rank_up_to_one():
    assert probe_clock_share(1, 2.0) == 1.0  # a whole core of its own: CPU time is its wall time
    assert probe_clock_share(1, 0.5) == 0.5  # a CFS quota of half a core: it computes half as fast
    assert probe_clock_share(2, 0.5) is None  # several threads (they also spin): wall time
    assert probe_clock_share(1, 0.0) is None


def test_a_probe_under_a_quota_counts_its_cpu_over_the_share_and_not_its_waits():
    spec = ProbeSpec("", 64, 1, 1, 0, 1, cpu_share=0.5)
    t0 = spec.now()
    time.sleep(0.05)  # another host computing on this core: no CPU of this process
    assert spec.now() - t0 < 0.02
    c0, t0 = time.process_time(), spec.now()
    _spin(0.03)
    t1, c1 = spec.now(), time.process_time()
    assert abs((t1 - t0) - 2 * (c1 - c0)) < 0.005 and t1 - t0 >= 0.06


def test_without_a_share_probes_are_timed_in_wall_time():
    spec = ProbeSpec("", 64, 1, 1, 0, 1)
    t0 = spec.now()
    time.sleep(0.05)
    assert spec.now() - t0 >= 0.05
