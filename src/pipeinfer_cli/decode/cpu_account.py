"""Where one process's CPU time goes: the target's layers, the draft model, and everything else.

A rank's CPU time (`time.process_time`: every thread of the process, the compute threads of ggml
and llama.cpp included) is cut into intervals at every change of what the process is doing, and
each interval is charged to one kind of work:

- `STAGE`: the target's layers (the native engine's evals) and the sampling of their rows;
- `DRAFT`: the draft model (its prompt pass and its proposals, llama.cpp's evals and the softmax
  over its vocabulary);
- `WAIT`: waiting for messages (probing MPI, sleeping between probes, waking up);
- `OWN`: everything else (scheduling runs, token trees and acceptance, vocabulary translation,
  encoding and receiving messages, Python).

The compute threads of a charged eval run while its caller waits inside it, so the process's CPU
over that interval is the eval's. When two threads charge at once (the draft model reading the
prompt in a thread while the head waits for its prefill), the interval goes to the kind that
computes: STAGE before DRAFT before WAIT. Since every interval is charged to exactly one kind, the
kinds add up to the process's CPU time over the same span, by construction.

The process has one account (`PROCESS`), as it has one CPU clock: the pipeline, the stages and the
draft model charge it, and the rank's report takes it (`runtime/rank_report.py`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

STAGE, DRAFT, WAIT, OWN = "stage", "draft", "wait", "own"
PRIORITY = (STAGE, DRAFT, WAIT)  # which kind an interval goes to when several are charged at once


@dataclass(frozen=True)
class CpuSplit:
    """One rank's CPU seconds over one span, by kind of work (docs/json-output.md, `ranks[].cpu_split`)."""

    stage_s: float  # the target's layers: engine evals and sampling their rows
    draft_s: float  # the draft model: prompt pass and proposals
    own_s: float  # everything else, waiting for messages included
    own_wait_s: float  # of own_s: waiting for messages (probes, sleeps between them, wake-ups)

    @property
    def total_s(self) -> float:
        return self.stage_s + self.draft_s + self.own_s

    @property
    def own_share(self) -> float | None:
        """own_s / total_s; None when the span took no CPU."""
        return self.own_s / self.total_s if self.total_s > 0 else None

    def as_dict(self) -> dict:
        return {"stage_s": round(self.stage_s, 4), "draft_s": round(self.draft_s, 4), "own_s": round(self.own_s, 4),
                "own_wait_s": round(self.own_wait_s, 4)}


class _Charge:
    """The context manager of one charge (a class, not a generator: it sits on the hot path)."""

    __slots__ = ("account", "kind")

    def __init__(self, account: "CpuAccount", kind: str):
        self.account, self.kind = account, kind

    def __enter__(self) -> None:
        self.account._begin(self.kind)

    def __exit__(self, *exc) -> None:
        self.account._end(self.kind)


class CpuAccount:
    """The process's CPU time, charged interval by interval to kinds of work (see the module doc).

    clock: the CPU clock (`time.process_time`; tests pass a fake)."""

    def __init__(self, clock: Callable[[], float] = time.process_time):
        self._clock = clock
        self._lock = threading.Lock()
        self._active = {kind: 0 for kind in PRIORITY}  # charges open now, per kind (any thread)
        self._charges = {kind: _Charge(self, kind) for kind in PRIORITY}
        self._since = clock()
        self._spent = {kind: 0.0 for kind in (*PRIORITY, OWN)}

    def charge(self, kind: str) -> _Charge:
        """`with account.charge(STAGE): ...` charges the CPU time of the block to STAGE."""
        return self._charges[kind]

    def _current(self) -> str:
        for kind in PRIORITY:
            if self._active[kind]:
                return kind
        return OWN

    def _mark(self) -> None:
        t = self._clock()
        self._spent[self._current()] += t - self._since
        self._since = t

    def _begin(self, kind: str) -> None:
        with self._lock:
            self._mark()
            self._active[kind] += 1

    def _end(self, kind: str) -> None:
        with self._lock:
            self._mark()
            self._active[kind] -= 1

    def take(self) -> CpuSplit:
        """The split since the previous take (or since the account was made); counting starts again."""
        with self._lock:
            self._mark()
            s = self._spent
            out = CpuSplit(stage_s=s[STAGE], draft_s=s[DRAFT], own_s=s[WAIT] + s[OWN], own_wait_s=s[WAIT])
            for kind in s:
                s[kind] = 0.0
        return out


PROCESS = CpuAccount()  # this process's account (one CPU clock per process)
