"""The debug fault injector: lose, delay or duplicate one message, or kill or freeze a rank at that
point, or make a rank raise, to test that every such fault ends in the right output or one clear error.

`PIPEINFER_DEBUG_FAULT=RANK:TAG:N:MODE[,…]` acts on the N-th message of tag TAG (a `Tag` name,
any case: stream, payload, result, result_data, cancel, error, abort, stats, draft_req,
draft_rep, clock, heartbeat) that rank RANK sends. MODE is one of

- `drop`: the message is never sent;
- `delay=S`: the rank sleeps S seconds (default 1) before sending it, so it arrives late;
- `dup`: the message is sent twice;
- `kill`: the rank kills itself (SIGKILL) instead of sending it;
- `sigill`: the rank raises SIGILL on itself instead of sending it, as ggml built with instructions
  the CPU does not run would (AMX on a VM that does not enable it);
- `stall`: the rank never sends it and stops making progress while it says it is computing, as a
  rank stuck in a compute would (its heartbeats continue).

`RANK:raise:N` makes rank RANK raise an error on its N-th run (a stage), draft proposal (the draft
rank) or committed token (the head, rank 0), as a failing rank would.

Several faults are separated by commas. Messages are counted per tag over the whole job, on the
sending rank (all destinations together); every fault fires once. PIPEINFER_DEBUG_FAULT_LOG=FILE
appends a line to FILE when a message fault fires.

PIPEINFER_DEBUG_FAIL=RANK:N, the older variable for `raise`, still works: it means
PIPEINFER_DEBUG_FAULT=RANK:raise:N (deprecated).

PIPEINFER_DEBUG_SLOW=RANK:FACTOR[,…] makes rank RANK's layer engine take FACTOR times as long for
every eval (it sleeps the difference, leaving the cores free): a slower node emulated on one
machine, for `--layer-split auto` and the planner (`calibrate` sees it too).

The process reads the environment once (`FaultInjector.from_env`) and hands the injector to its
`Link`; the rank's code asks the injector (`link.faults`), never the environment.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import UsageError
from .messages import Tag

FAULT_ENV = "PIPEINFER_DEBUG_FAULT"
LOG_ENV = "PIPEINFER_DEBUG_FAULT_LOG"  # a file: one line per fault that fired (time, rank, tag, n, mode)
SLOW_ENV = "PIPEINFER_DEBUG_SLOW"  # RANK:FACTOR[,…]: that rank's engine computes FACTOR times as slowly
FAIL_ENV = "PIPEINFER_DEBUG_FAIL"  # deprecated: RANK:N means PIPEINFER_DEBUG_FAULT=RANK:raise:N
MODES = ("drop", "delay", "dup", "kill", "sigill", "stall")
RAISE = "raise"  # not a message fault: the rank raises at its N-th run, draft proposal or token


@dataclass
class Fault:
    """One planned fault: on `rank`, the `nth` message of `tag` gets `mode`; or, with mode "raise"
    (tag None), the rank raises at its `nth` run, draft proposal or token."""

    rank: int
    tag: Tag | None
    nth: int
    mode: str
    delay_s: float = 1.0


def parse_faults(spec: str) -> list[Fault]:
    """PIPEINFER_DEBUG_FAULT's value as faults; a UsageError names a bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        fields = part.split(":")
        try:
            if len(fields) == 3 and fields[1].lower() == RAISE:
                fault = Fault(int(fields[0]), None, int(fields[2]), RAISE)
            else:
                rank, tag, nth, mode = fields
                mode, _, arg = mode.partition("=")
                fault = Fault(int(rank), Tag[tag.upper()], int(nth), mode.lower(), float(arg) if arg else 1.0)
        except (ValueError, KeyError):
            fault = None
        if (fault is None or fault.mode not in (MODES if fault.tag is not None else (RAISE,)) or fault.nth < 1
                or fault.rank < 0):
            raise UsageError(f"{FAULT_ENV}: cannot read {part!r}; write RANK:TAG:N:MODE with TAG one of "
                             f"{', '.join(t.name.lower() for t in Tag)} and MODE one of drop, delay=S, dup, kill, "
                             "sigill, stall, or RANK:raise:N")
        faults.append(fault)
    return faults


def fail_alias(spec: str) -> str:
    """PIPEINFER_DEBUG_FAIL's value (RANK[:N], N 1 if left out) in PIPEINFER_DEBUG_FAULT's syntax."""
    parts = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        rank, _, n = part.partition(":")
        parts.append(f"{rank}:{RAISE}:{n or 1}")
    return ",".join(parts)


def fault_spec(environ: Mapping[str, str] | None = None) -> str:
    """The faults the environment asks for: PIPEINFER_DEBUG_FAULT, and the deprecated
    PIPEINFER_DEBUG_FAIL in its syntax."""
    env = os.environ if environ is None else environ
    return ",".join(filter(None, (env.get(FAULT_ENV, ""), fail_alias(env.get(FAIL_ENV, "")))))


class FaultInjector:
    """This rank's planned faults: `Link` consults it before every send (`copies`), the rank's code
    asks it where to raise (`raise_at`)."""

    def __init__(self, rank: int, faults: list[Fault]):
        mine = [f for f in faults if f.rank == rank]
        self.faults = [f for f in mine if f.mode != RAISE]  # message faults
        # The rank raises at its raise_at-th run, draft proposal or token (None: never).
        self.raise_at: int | None = min((f.nth for f in mine if f.mode == RAISE), default=None)
        self.sent: dict[Tag, int] = {}  # messages of each tag this rank sent (or tried to)

    @classmethod
    def from_env(cls, rank: int, environ: Mapping[str, str] | None = None) -> "FaultInjector | None":
        """Rank's injector as the environment plans it (see the module doc); None if it plans
        nothing for this rank."""
        spec = fault_spec(environ)
        injector = cls(rank, parse_faults(spec)) if spec else None
        return injector if injector is not None and (injector.faults or injector.raise_at is not None) else None

    def copies(self, tag: Tag, on_stall) -> int:
        """How many copies of this message to send (0: dropped), after any delay, kill or stall.

        on_stall(): called before a stall, so the rank can say that it is computing."""
        if not self.faults:
            return 1
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
        elif fault.mode == "sigill":
            os.kill(os.getpid(), signal.SIGILL)
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


def slowdown_for(rank: int, environ: Mapping[str, str] = os.environ) -> float:
    """PIPEINFER_DEBUG_SLOW's factor for this rank (1.0: none); a UsageError names a bad part."""
    factor = 1.0
    for part in filter(None, (p.strip() for p in environ.get(SLOW_ENV, "").split(","))):
        r, _, f = part.partition(":")
        try:
            r_i, f_v = int(r), float(f)
        except ValueError:
            r_i, f_v = -1, 0.0
        if r_i < 0 or not f_v >= 1.0:
            raise UsageError(f"{SLOW_ENV}: cannot read {part!r}; write RANK:FACTOR with FACTOR >= 1, e.g. 1:2")
        if r_i == rank:
            factor = f_v
    return factor


STREAM_RATE_ENV = "PIPEINFER_DEBUG_STREAM_RATE"


def stream_rate_limit(environ: Mapping[str, str] = os.environ) -> float | None:
    """PIPEINFER_DEBUG_STREAM_RATE: the most bytes per second the head streams weights at (to cut a
    stream in the middle in tests, or see the progress lines on one machine); None: no limit."""
    text = environ.get(STREAM_RATE_ENV, "").strip()
    if not text:
        return None
    try:
        rate = float(text)
    except ValueError:
        rate = 0.0
    if not rate > 0:
        raise UsageError(f"{STREAM_RATE_ENV}: cannot read {text!r}; write a number of bytes per second, e.g. 20e6")
    return rate
