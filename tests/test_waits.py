"""How a rank waits for a message: the predicted sleep, and the brief spin after it for a rank alone on its cores."""

from __future__ import annotations

import pytest

from pipeinfer_cli.runtime import topology
from pipeinfer_cli.transport import mpi_link
from pipeinfer_cli.transport.waits import PREDICT_WAITS, SPIN_TAIL_S, Backoff, WaitHistory, WaitPolicy


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


def test_a_rank_alone_spins_only_after_its_predicted_sleep_and_briefly(clock):
    policy = WaitPolicy(spin="tail").for_cores(alone_on_cores=True)
    b = Backoff(policy, WaitHistory(), site="stream")
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


def test_ranks_that_share_cores_never_spin(clock):
    b = Backoff(WaitPolicy(spin="tail").for_cores(alone_on_cores=False), WaitHistory(), site="stream")
    assert sum(wait_once(clock, b, 0.030) for _ in range(PREDICT_WAITS + 4)) == 0


def test_without_prediction_a_wait_is_polled_from_the_start(clock):
    """PIPEINFER_WAIT_PREDICT=0: no sleep through a wait, however regular the waits."""
    policy = WaitPolicy.from_env({"PIPEINFER_WAIT_PREDICT": "0"})
    b = Backoff(policy, WaitHistory(predict=policy.predict), site="stream")
    for _ in range(PREDICT_WAITS + 1):
        first = len(clock.sleeps)
        wait_once(clock, b, 0.030)
    assert clock.sleeps[first] == b.lo


def test_only_a_rank_alone_that_asked_stays_awake():
    for env, alone, awake in (("", True, False), ("0", True, False), ("tail", True, True), ("tail", False, False)):
        policy = WaitPolicy.from_env({"PIPEINFER_WAIT_SPIN": env}).for_cores(alone)
        assert policy.spin_tail is awake, (env, alone)
        assert policy.style() == ("sleep, then awake up to 10 ms" if awake else "sleep")
    assert WaitPolicy.from_env({"PIPEINFER_WAIT_SPIN": "1"}).for_cores(True).style() == "spin"
    assert WaitPolicy.from_env({}) == WaitPolicy(predict=True, spin="", spin_tail=False)


def test_the_link_owns_its_wait_policy_and_history():
    """A Link's backoffs share its history and take its policy as it is when they are made."""
    from mpi4py import MPI

    link = mpi_link.Link(MPI.COMM_SELF, WaitPolicy(spin="tail"))
    before = link.backoff(site="stream")
    assert link.set_alone_on_cores(True) is True
    after = link.backoff(site="stream", hi=2e-3)
    assert (before.spin_tail, after.spin_tail, after.hi) == (False, True, 2e-3)
    assert before.history is after.history is link.wait_history
    assert link.wait_policy.style() == "sleep, then awake up to 10 ms"


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


def test_a_rank_under_a_quota_below_one_cpu_wakes_up_less_often(clock):
    """Every wake-up comes out of a quota of a quarter of a core: soon after progress the wait
    sleeps up to 1 ms at a time, not 0.1 ms (without prediction, a 30 ms wait)."""
    def sleeps_in_a_wait(policy: WaitPolicy) -> list[float]:
        b = Backoff(policy, WaitHistory(predict=False), site="stream")
        first = len(clock.sleeps)
        wait_once(clock, b, 0.030)
        return clock.sleeps[first:]

    free, capped = sleeps_in_a_wait(WaitPolicy()), sleeps_in_a_wait(WaitPolicy().for_quota(0.25))
    assert max(free) == pytest.approx(1e-4) and max(capped) == pytest.approx(1e-3)
    assert len(capped) * 5 < len(free)
    assert WaitPolicy().for_quota(None) == WaitPolicy().for_quota(2.0) == WaitPolicy()


def test_a_long_wait_probes_less_often_after_deep_idle(clock):
    from pipeinfer_cli.transport.waits import BACKOFF_MAX_S, DEEP_IDLE_MAX_S, DEEP_IDLE_S

    b = Backoff(WaitPolicy(predict=False))
    end = clock.now + DEEP_IDLE_S + 0.2
    while clock.now < end:
        b.idle()
    t, sleeps = 1000.0, []
    for s in clock.sleeps:  # each sleep with the wait's age when it began
        sleeps.append((t - 1000.0, s))
        t += s
    young = [s for age, s in sleeps if age < DEEP_IDLE_S - 0.01]
    old = [s for age, s in sleeps if age > DEEP_IDLE_S + 0.05]
    assert max(young) == pytest.approx(BACKOFF_MAX_S)
    assert old and min(old) == pytest.approx(DEEP_IDLE_MAX_S)
    b.reset()
    b.idle()
    assert clock.sleeps[-1] < BACKOFF_MAX_S  # after progress the next wait starts fine again

