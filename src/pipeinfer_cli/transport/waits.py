"""How a rank waits for a message without spinning: Iprobe + sleep with exponential backoff.

The mpich wheel's blocking Recv busy-waits (a full core while idle), and several ranks may share a
core, so every wait is a probe followed by a sleep that grows while the wait lasts and starts
small again after progress. `WaitPolicy` is read once from the environment and owned by the
`Link`, which makes every `Backoff` with it (no module state, no environment read per wait).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace

BACKOFF_MIN_S = 20e-6
BACKOFF_MAX_S = 1e-3  # the longest sleep of a rank that has been idle for a while
# A rank that just made progress expects the next message soon (the pipeline is running): for
# BACKOFF_HOT_S it sleeps at most BACKOFF_HOT_MAX_S between probes, so it notices the next run
# soon after it arrives; only an idle rank backs off to BACKOFF_MAX_S (BENCHMARKS.md, "Hand-off
# between stages" and "Figures formerly quoted in source comments").
BACKOFF_HOT_MAX_S = 1e-4
BACKOFF_HOT_S = 0.05
# A rank held below one CPU by a CFS quota (a container's --cpus, an emulated host's --cpus) pays
# every wake-up out of its quota: each costs about 14 us of CPU on the test VM (the sleep's own
# system calls, however short the sleep), so probing every 0.1 ms takes a seventh of a core, more
# than half of a 0.25-CPU host, and the rank's own work waits for it. Its quota's period (1 to 4 ms
# below one CPU) already delays it by that much whenever it is throttled, so its hot phase sleeps
# up to BACKOFF_MAX_S as an idle wait does (`WaitPolicy.for_quota`).
QUOTA_HOT_MAX_S = BACKOFF_MAX_S
# A wait that has lasted DEEP_IDLE_S (a server between requests, a late stage before the prompt's
# first chunk reaches it) sleeps up to DEEP_IDLE_MAX_S between probes: every wake-up costs CPU
# (BENCHMARKS.md, "One poller per waiting stage"), and a few milliseconds more before the first
# message of a new request are nothing beside it.
DEEP_IDLE_S = 1.0
DEEP_IDLE_MAX_S = 5e-3


# A wait that has lasted about the same for a while (the next stage's compute, in a steady
# pipeline) is slept through in one go, up to PREDICT_FRACTION of the shortest of the last
# PREDICT_WAITS waits at that site, then polled finely as above. Probing every 0.1 ms wakes the
# waiting rank ten thousand times a second; sleeping through saves those wake-ups' CPU. (That they
# also slow the rank that computes was suspected and measured not to be so: BENCHMARKS.md, "A
# polling neighbour is not the cause".) PIPEINFER_WAIT_PREDICT=0 turns it off.
PREDICT_WAITS = 8
PREDICT_FRACTION = 0.8
PREDICT_ENV = "PIPEINFER_WAIT_PREDICT"
# With PIPEINFER_WAIT_SPIN=tail, a rank alone on its cores probes without sleeping once a predicted
# wait's sleep is over, for at most SPIN_TAIL_S, so that its core is awake when the other stage's
# message arrives: on the test VM a computation that follows a sleep runs slower than one that
# follows work (BENCHMARKS.md, idle_gap.py). Through the CLI the gain did not hold up and the spin costs
# CPU, so it is not the default (BENCHMARKS.md, "Pipeline overhead: 2 ranks against 1").
# Ranks that share cores never spin. PIPEINFER_WAIT_SPIN=1 is a diagnostic, not a mode for users:
# every wait a busy probe loop.
SPIN_TAIL_S = 0.01
SPIN_ENV = "PIPEINFER_WAIT_SPIN"


@dataclass(frozen=True)
class WaitPolicy:
    """How this process waits for messages: read once from the environment (`from_env`), owned by
    its `Link`, and handed to every `Backoff` the link makes.

    predict: sleep through a wait as long as the recent ones (PIPEINFER_WAIT_PREDICT, default on);
    spin: PIPEINFER_WAIT_SPIN as given ("1": every wait a busy probe loop; "tail": a rank alone on
    its cores may stay awake after a predicted sleep); spin_tail: this rank does stay awake, decided
    once the job knows who shares cores (`for_cores`)."""

    predict: bool = True
    spin: str = ""
    spin_tail: bool = False
    hot_hi: float = BACKOFF_HOT_MAX_S  # the longest sleep soon after progress (`for_quota`)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "WaitPolicy":
        env = os.environ if environ is None else environ
        return cls(predict=env.get(PREDICT_ENV, "1") != "0", spin=env.get(SPIN_ENV, ""))

    @property
    def spin_always(self) -> bool:
        return self.spin == "1"

    def for_cores(self, alone_on_cores: bool) -> "WaitPolicy":
        """This policy for a rank that has (or has not) its cores to itself: it stays awake after a
        predicted sleep only when PIPEINFER_WAIT_SPIN=tail asked and it is alone."""
        return replace(self, spin_tail=self.spin == "tail" and alone_on_cores)

    def for_quota(self, quota_cpus: float | None) -> "WaitPolicy":
        """This policy for a rank under a CFS quota of quota_cpus CPUs (None: none): below one CPU,
        its waits never probe more often than every QUOTA_HOT_MAX_S."""
        return replace(self, hot_hi=QUOTA_HOT_MAX_S if quota_cpus is not None and quota_cpus < 1.0 else BACKOFF_HOT_MAX_S)

    def style(self) -> str:
        """How this process waits for messages, as the JSON reports it per rank."""
        if self.spin_always:
            return "spin"
        return f"sleep, then awake up to {SPIN_TAIL_S * 1e3:g} ms" if self.spin_tail else "sleep"


class WaitHistory:
    """The durations of one process's recent waits, per wait site (kept by its `Link`).

    predict: False makes every prediction 0 (PIPEINFER_WAIT_PREDICT=0)."""

    def __init__(self, n: int = PREDICT_WAITS, predict: bool = True):
        self.n, self.predict = n, predict
        self.recent: dict[str, deque[float]] = {}

    def record(self, site: str, seconds: float) -> None:
        self.recent.setdefault(site, deque(maxlen=self.n)).append(seconds)

    def sleep_through(self, site: str) -> float:
        """How long a new wait at site may sleep before its first probe (0 until n waits are known)."""
        waits = self.recent.get(site)
        if not self.predict or waits is None or len(waits) < self.n:
            return 0.0
        return PREDICT_FRACTION * min(waits)


class Backoff:
    """Sleep a little longer each idle round, finely while the wait is young; reset() after progress.

    policy: how this process waits (`WaitPolicy`, as it is when the Backoff is made; `Link.backoff`
    makes one with the link's). site: names the wait (e.g. "result", "stream") so that a predictable
    one is slept through, from the waits recorded in history (`WaitHistory`); a wait ends, and is
    recorded, at reset(). Without a site or a history there is no prediction."""

    __slots__ = ("lo", "hi", "hot_hi", "hot_s", "site", "history", "spin", "spin_tail", "delay", "idle_since",
                 "wake_at")

    def __init__(self, policy: WaitPolicy, history: WaitHistory | None = None, lo: float = BACKOFF_MIN_S,
                 hi: float = BACKOFF_MAX_S, hot_hi: float | None = None, hot_s: float = BACKOFF_HOT_S,
                 site: str | None = None):
        self.lo, self.hi, self.hot_s = lo, hi, hot_s
        self.hot_hi = min(policy.hot_hi if hot_hi is None else hot_hi, hi)
        self.site = site
        self.history = history if site is not None else None
        self.spin, self.spin_tail = policy.spin_always, policy.spin_tail  # copied: idle() is the hot path
        self.delay = lo
        self.idle_since: float | None = None
        self.wake_at = 0.0

    def reset(self) -> None:
        if self.history is not None and self.idle_since is not None:
            self.history.record(self.site, time.monotonic() - self.idle_since)
        self.delay = self.lo
        self.idle_since = None

    def idle(self) -> None:
        if self.spin:
            time.sleep(0)  # a system call that never halts the core, and lets the rank's other thread run
            return
        now = time.monotonic()
        if self.idle_since is None:
            self.idle_since = now
            self.wake_at = now + (self.history.sleep_through(self.site) if self.history is not None else 0.0)
        if now + self.lo < self.wake_at:
            time.sleep(self.wake_at - now)
            return
        if self.spin_tail and self.wake_at > self.idle_since and now < self.wake_at + SPIN_TAIL_S:
            return  # awake for the message that the last waits say is due
        time.sleep(self.delay)
        age = now - self.idle_since
        cap = self.hot_hi if age < self.hot_s else self.hi if age < DEEP_IDLE_S else max(self.hi, DEEP_IDLE_MAX_S)
        self.delay = min(self.delay * 2, cap)
