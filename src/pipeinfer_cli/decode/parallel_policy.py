"""Parallel requests on one pipeline (`serve --parallel N`): which slot a request takes, and when a
request may speculate while others run. Pure decisions (no MPI, no threads), tested on their own.

Slots. Every slot owns 1/N of the KV cells and of the sequence ids on every stage (the engine's KV
slots): a request computes exactly what it would alone, whatever runs beside it. A new request
takes the idle slot whose remembered prefix it can reuse the most (`prefix_cache.py`), else the
idle slot used longest ago (llama-server's choice by prompt similarity, then LRU).

Speculation under load (`--load-policy`). A pipeline of S stages is full with S runs in flight.
With one request running, PipeInfer fills it with speculation, as always. With R >= 2 requests,
each keeps one non-speculative run in flight (its next token); a speculative run then only pays
where a stage would otherwise idle, so:

- `yield` (default): a request may launch a speculative run only while the runs in flight, with
  every request counted as at least the one run its next token needs, are fewer than S; its
  non-speculative runs are never held back. With R >= S nobody speculates; with R < S the spare
  stages carry speculation.
- `round-robin`: every request runs its mode as if alone; the stages take runs in arrival order.
- `no-spec`: no speculation at all while two or more requests run.

The draft model. A job has one draft model (on the head or on a draft rank), and it drafts for one
request at a time (`DraftLender`): the request that finds it free holds it until it ends; another
request drafts meanwhile with the fallback (prompt lookup when the job's draft includes it, else
nothing). The server (runtime/parallel.py) and the planner's simulated server
(planner/sim_slots.py) both lend it through this class.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .prefix_cache import PrefixCache

LOAD_POLICIES = ("yield", "round-robin", "no-spec")


def may_speculate(policy: str, inflight: list[int], n_stages: int) -> bool:
    """Whether a request may launch a speculative run now (or, in speculative mode, put drafts in
    its next run).

    inflight: runs in flight (not cancelled) of every request generating, this one included. Each
    request is counted as at least one run, the one it needs for its next token, so that a
    speculative run never takes the stage another request's next token will need."""
    if len(inflight) <= 1 or policy == "round-robin":
        return True
    if policy == "no-spec":
        return False
    return sum(max(1, n) for n in inflight) < n_stages


@dataclass
class Slot:
    index: int
    prefix: PrefixCache = field(default_factory=PrefixCache)
    busy: bool = False
    last_used: int = 0  # order of the last request it served (0: never)


class SlotTable:
    """The job's N slots on the head: which are busy, and what each slot's cache holds."""

    def __init__(self, n_slots: int, reuse_prefix: bool = True, ubatch: int | None = None):
        self.slots = [Slot(i, PrefixCache(ubatch=ubatch)) for i in range(n_slots)]
        self.reuse_prefix = reuse_prefix
        self._served = 0

    @property
    def n_idle(self) -> int:
        return sum(not s.busy for s in self.slots)

    def pick(self, prompt: list[int]) -> Slot | None:
        """The idle slot for this prompt (most reusable prefix, then least recently used), marked
        busy; None when every slot is busy."""
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None

        def score(s: Slot) -> tuple[int, int]:
            keep = s.prefix.plan(prompt)[0] if self.reuse_prefix else 0
            return keep, -s.last_used

        best = max(idle, key=score)
        best.busy = True
        self._served += 1
        best.last_used = self._served
        return best

    def release(self, slot: Slot) -> None:
        slot.busy = False


class DraftLender:
    """Who holds the job's draft model: one request at a time, the first that finds it free, until
    it ends. Not thread-safe on its own: the server calls it under a lock."""

    def __init__(self) -> None:
        self.holder: int | None = None  # the slot holding it
        self.last_slot: int | None = None  # the slot whose tokens the draft's cache holds

    def take(self, slot: int, reuse: int) -> tuple[bool, int]:
        """(held, draft_reuse) for a request in `slot` whose target keeps `reuse` prompt tokens:
        held, the request drafts with the model, whose cache keeps draft_reuse tokens (its own
        slot's, if it served that slot last, else none); not held, it drafts with the fallback."""
        if self.holder is not None:
            return False, reuse
        self.holder = slot
        draft_reuse = reuse if self.last_slot == slot else 0
        self.last_slot = slot
        return True, draft_reuse

    def give_back(self, slot: int) -> None:
        if self.holder == slot:
            self.holder = None
