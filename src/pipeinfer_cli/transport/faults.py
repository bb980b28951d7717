"""A debug fault injector in the transport: lose, delay or duplicate one message, or kill or freeze a
rank at that point, to test that every such fault ends in the right output or one clear error.

`PIPEINFER_DEBUG_FAULT=RANK:TAG:N:MODE[,…]` acts on the N-th message of tag TAG (a `Tag` name,
any case: stream, payload, result, result_data, cancel, error, abort, stats, draft_req,
draft_rep, clock, heartbeat) that rank RANK sends. MODE is one of

- `drop`: the message is never sent;
- `delay=S`: the rank sleeps S seconds (default 1) before sending it, so it arrives late;
- `dup`: the message is sent twice;
- `kill`: the rank kills itself (SIGKILL) instead of sending it;
- `stall`: the rank never sends it and stops making progress while it says it is computing, as a
  rank stuck in a compute would (its heartbeats continue).

Several faults are separated by commas. Messages are counted per tag over the whole job, on the
sending rank (all destinations together); every fault fires once. PIPEINFER_DEBUG_FAULT_LOG=FILE
appends a line to FILE when a fault fires.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from ..errors import UsageError
from .messages import Tag

FAULT_ENV = "PIPEINFER_DEBUG_FAULT"
LOG_ENV = "PIPEINFER_DEBUG_FAULT_LOG"  # a file: one line per fault that fired (time, rank, tag, n, mode)
MODES = ("drop", "delay", "dup", "kill", "stall")


@dataclass
class Fault:
    """One planned fault: on `rank`, the `nth` message of `tag` gets `mode`."""

    rank: int
    tag: Tag
    nth: int
    mode: str
    delay_s: float = 1.0


def parse_faults(spec: str) -> list[Fault]:
    """PIPEINFER_DEBUG_FAULT's value as faults; a UsageError names a bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        fields = part.split(":")
        try:
            rank, tag, nth, mode = fields
            mode, _, arg = mode.partition("=")
            fault = Fault(int(rank), Tag[tag.upper()], int(nth), mode.lower(), float(arg) if arg else 1.0)
        except (ValueError, KeyError):
            fault = None
        if fault is None or fault.mode not in MODES or fault.nth < 1 or fault.rank < 0:
            raise UsageError(f"{FAULT_ENV}: cannot read {part!r}; write RANK:TAG:N:MODE with TAG one of "
                             f"{', '.join(t.name.lower() for t in Tag)} and MODE one of drop, delay=S, dup, kill, stall")
        faults.append(fault)
    return faults


class FaultInjector:
    """This rank's planned faults, consulted by `Link` before every send."""

    def __init__(self, rank: int, faults: list[Fault]):
        self.faults = [f for f in faults if f.rank == rank]
        self.sent: dict[Tag, int] = {}  # messages of each tag this rank sent (or tried to)

    @classmethod
    def from_env(cls, rank: int) -> "FaultInjector | None":
        spec = os.environ.get(FAULT_ENV, "")
        injector = cls(rank, parse_faults(spec)) if spec else None
        return injector if injector is not None and injector.faults else None

    def copies(self, tag: Tag, on_stall) -> int:
        """How many copies of this message to send (0: dropped), after any delay, kill or stall.

        on_stall(): called before a stall, so the rank can say that it is computing."""
        tag = Tag(tag)
        n = self.sent[tag] = self.sent.get(tag, 0) + 1
        fault = next((f for f in self.faults if f.tag == tag and f.nth == n), None)
        if fault is None:
            return 1
        _log(fault, n)
        if fault.mode == "delay":
            time.sleep(fault.delay_s)
        elif fault.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.mode == "stall":
            on_stall()
            while True:
                time.sleep(3600)
        return {"drop": 0, "dup": 2}.get(fault.mode, 1)


def _log(fault: Fault, n: int) -> None:
    """Append the fault that fires to PIPEINFER_DEBUG_FAULT_LOG, if set (the fault matrix reads it)."""
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{time.time():.3f} {fault.rank} {fault.tag.name} {n} {fault.mode}\n")
