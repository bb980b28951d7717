"""How a rank waits for a message: the predicted sleep, and the brief spin after it for a rank alone on its cores."""

from __future__ import annotations

import pytest

from pipeinfer_cli.runtime import topology
from pipeinfer_cli.transport import mpi_link
from pipeinfer_cli.transport.mpi_link import PREDICT_WAITS, SPIN_TAIL_S, Backoff


class FakeClock:
    """time.monotonic and time.sleep for mpi_link, on a virtual clock that only sleeps move."""

    def __init__(self):
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(mpi_link.time, "monotonic", c.monotonic)
    monkeypatch.setattr(mpi_link.time, "sleep", c.sleep)
    monkeypatch.setattr(mpi_link, "WAITS", mpi_link.WaitHistory())
    monkeypatch.setattr(mpi_link, "PREDICT_ENABLED", True)
    return c


def wait_once(clock: FakeClock, b: Backoff, seconds: float) -> int:
    """One wait of `seconds` (virtual); returns how many probes ran without sleeping (spins)."""
    end, spins = clock.now + seconds, 0
    while clock.now < end:
        before = len(clock.sleeps)
        b.idle()
        if len(clock.sleeps) == before:
            spins += 1
            clock.now += 1e-5  # a probe's own cost
            if spins > 100_000:
                raise AssertionError("the wait never slept again")
    b.reset()
    return spins


def test_a_rank_alone_spins_only_after_its_predicted_sleep_and_briefly(clock, monkeypatch):
    monkeypatch.setattr(mpi_link, "_SPIN_ENV", "tail")
    mpi_link.set_spin_tail(True)
    try:
        b = Backoff(site="stream")
        # Until PREDICT_WAITS waits are known there is no prediction, so no spinning either.
        assert [wait_once(clock, b, 0.030) for _ in range(PREDICT_WAITS)] == [0] * PREDICT_WAITS
        first = len(clock.sleeps)
        spins = wait_once(clock, b, 0.030)
        # The prediction sleeps through 0.8 x 30 ms in one go, then the rank stays awake for the rest.
        assert clock.sleeps[first:] == [pytest.approx(0.8 * 0.030, rel=0.01)]  # the waits ran a hair over 30 ms
        assert spins * 1e-5 == pytest.approx(0.030 - 0.8 * 0.030, abs=1e-4)
        # A much longer wait (the pipeline went idle): at most SPIN_TAIL_S of spinning, then sleeps.
        long_spins = wait_once(clock, b, 2.0)
        assert 0 < long_spins * 1e-5 <= SPIN_TAIL_S + 1e-4
    finally:
        mpi_link.set_spin_tail(False)


def test_ranks_that_share_cores_never_spin(clock):
    mpi_link.set_spin_tail(False)
    b = Backoff(site="stream")
    assert sum(wait_once(clock, b, 0.030) for _ in range(PREDICT_WAITS + 4)) == 0


def test_only_a_rank_alone_that_asked_stays_awake(monkeypatch):
    try:
        for env, alone, awake in (("", True, False), ("0", True, False), ("tail", True, True), ("tail", False, False)):
            monkeypatch.setattr(mpi_link, "_SPIN_ENV", env)
            assert mpi_link.set_spin_tail(alone) is awake, (env, alone)
            assert mpi_link.wait_style() == ("sleep, then awake up to 10 ms" if awake else "sleep")
    finally:
        monkeypatch.setattr(mpi_link, "_SPIN_ENV", "")
        mpi_link.set_spin_tail(False)


@pytest.mark.parametrize("cpus, affinity, here, mine, alone", [
    (2, 2, 2, 1, True),    # 2 ranks x 1 thread on 2 cores
    (2, 2, 4, 2, False),   # 2 ranks x 2 threads on 2 cores: they share
    (2, 2, 3, 1, False),   # 3 ranks x 1 thread on 2 cores
    (2, 2, 4, 2, False),   # the head with a draft model beside its engine, and one more rank
    (64, 16, 64, 16, True),  # bound by the launcher to 16 CPUs of its own, 16 threads
    (64, 16, 64, 32, False),  # bound to 16 CPUs, 32 threads
])
def test_alone_on_cores(monkeypatch, cpus, affinity, here, mine, alone):
    monkeypatch.setattr(topology.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(topology.os, "sched_getaffinity", lambda pid: set(range(affinity)))
    assert topology.alone_on_cores(here, mine) is alone
