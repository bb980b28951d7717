"""The CPU account: every interval of the process's CPU clock goes to exactly one kind of work, so
the kinds add up to the clock; concurrent charges go to the kind that computes."""

from __future__ import annotations

import threading

import pytest

from pipeinfer_cli.decode.cpu_account import DRAFT, STAGE, WAIT, CpuAccount


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_each_interval_goes_to_the_kind_charged_then():
    clock = FakeClock()
    acc = CpuAccount(clock)
    clock.t = 1.0  # own
    with acc.charge(STAGE):
        clock.t = 3.0
    with acc.charge(DRAFT):
        clock.t = 3.5
    with acc.charge(WAIT):
        clock.t = 3.75
    clock.t = 4.0  # own
    split = acc.take()
    assert (split.stage_s, split.draft_s, split.own_s, split.own_wait_s) == (2.0, 0.5, 1.5, 0.25)
    assert split.total_s == 4.0 and split.own_share == pytest.approx(1.5 / 4.0)
    clock.t = 5.0
    assert acc.take().own_s == 1.0  # counting started again at the previous take


def test_overlapping_charges_go_to_the_kind_that_computes():
    """The draft model reading the prompt in a thread while the head waits for its prefill: the
    overlap is the draft's; a stage eval inside anything is the stage's."""
    clock = FakeClock()
    acc = CpuAccount(clock)
    wait = acc.charge(WAIT)
    wait.__enter__()
    clock.t = 1.0
    with acc.charge(DRAFT):
        clock.t = 3.0
        with acc.charge(STAGE):
            clock.t = 4.0
        clock.t = 5.0
    clock.t = 6.0
    wait.__exit__(None, None, None)
    split = acc.take()
    assert (split.stage_s, split.draft_s, split.own_wait_s, split.own_s) == (1.0, 3.0, 2.0, 2.0)


def test_the_kinds_add_up_to_the_process_cpu_clock():
    """On the real clock, with a thread charging beside the main one."""
    acc = CpuAccount()
    acc.take()

    def burn(n: int) -> None:
        x = 0
        for i in range(n):
            x += i * i

    def drafting() -> None:
        with acc.charge(DRAFT):
            burn(200_000)

    t = threading.Thread(target=drafting)
    with acc.charge(STAGE):
        burn(200_000)
    t.start()
    with acc.charge(WAIT):
        t.join()
    burn(100_000)
    import time

    c0 = time.process_time()
    acc2 = CpuAccount()
    burn(100_000)
    split2 = acc2.take()
    c1 = time.process_time()
    split = acc.take()
    for v in (split.stage_s, split.draft_s, split.own_s, split.own_wait_s):
        assert v >= 0
    assert split.stage_s > 0 and split.draft_s > 0 and split.own_s > 0
    assert split.own_wait_s <= split.own_s
    # one account over a span measures that span's process CPU time
    assert split2.total_s == pytest.approx(c1 - c0, abs=2e-3)
