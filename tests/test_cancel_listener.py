"""A stage's CANCEL listener: it polls only while its stage computes; while the stage waits for its
stream, the stage's main thread receives CANCEL and ABORT itself (no second poller waking up)."""

from __future__ import annotations

import threading
import time

import numpy as np

from pipeinfer_cli.runtime.stage import CancelListener
from pipeinfer_cli.transport.messages import Tag
from pipeinfer_cli.transport.waits import Backoff, WaitPolicy


class FakeLink:
    """The part of a Link the listener uses; counts probes per thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.cancels: list[np.ndarray] = []
        self.abort = False
        self.probes: dict[str, int] = {}

    def backoff(self, **kw) -> Backoff:
        return Backoff(WaitPolicy(predict=False), **kw)

    def probe(self, source: int, tag: Tag):
        name = threading.current_thread().name
        with self.lock:
            self.probes[name] = self.probes.get(name, 0) + 1
            return True if tag == Tag.CANCEL and self.cancels else None

    def recv_array(self, source, tag, dtype, st):
        with self.lock:
            return self.cancels.pop(0)

    def abort_requested(self) -> bool:
        self.probe(0, Tag.ABORT)
        return self.abort


class FakeEngine:
    def __init__(self):
        self.cancels = 0

    def cancel(self):
        self.cancels += 1

    def clear_cancel(self):
        pass


def test_the_listener_sleeps_while_its_stage_waits_and_polls_while_it_computes():
    link, engine = FakeLink(), FakeEngine()
    listener = CancelListener(link, engine)
    listener.start()
    try:
        time.sleep(0.3)  # the stage waits for its stream: the listener must not probe
        assert link.probes.get("cancel-listener", 0) == 0
        link.cancels.append(np.asarray([7], np.int64))
        assert listener.poll()  # the main thread, between its own probes, receives it
        assert not listener.begin(7)  # so run 7 is skipped
        assert listener.begin(8)
        time.sleep(0.1)  # while run 8 computes the listener polls ...
        assert link.probes.get("cancel-listener", 0) > 0
        link.cancels.append(np.asarray([8], np.int64))
        deadline = time.monotonic() + 2
        while engine.cancels == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert engine.cancels == 1  # ... and cancels it mid-compute
        listener.end(8)
        time.sleep(0.05)
        before = link.probes["cancel-listener"]
        time.sleep(0.3)
        assert link.probes["cancel-listener"] <= before + 1  # asleep again once the run ended
    finally:
        listener.stop()
        listener.join(timeout=2)
    assert not listener.is_alive()


def test_an_abort_seen_by_the_main_thread_ends_the_listener():
    link, engine = FakeLink(), FakeEngine()
    listener = CancelListener(link, engine)
    listener.start()
    link.abort = True
    listener.poll()
    assert listener.aborted.is_set() and engine.cancels == 1
    listener.join(timeout=2)  # it wakes within LISTENER_IDLE_S and leaves
    assert not listener.is_alive()
