"""How a job's KV cache is shared out: sequences and cells per request slot, in one place.

Every stage opens one engine of `n_seq` sequence ids and `n_ctx` cells; `serve --parallel N` cuts
it into N slots, each a request's own sequences and cells (`runtime/slot_pipeline.py`). A request
needs its canonical sequence, one per speculative run in flight and tree branch (pipeinfer), and a
spare (`sequences_per_request`); the loader, the server's checks, the slot multiplexer and the
planner's simulated pipeline all read the count here.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SEQUENCES = 64  # the engine's sequence ids
SLOT_CELL_BLOCK = 256  # a parallel slot's cells come in whole blocks of this many


def sequences_per_request(max_inflight: int, max_branches: int, drafts: bool = True) -> int:
    """KV sequences one request uses: the canonical one, one per in-flight run and tree branch,
    and a spare; at most MAX_SEQUENCES. A request that never drafts (a parallel server without a
    draft) uses the canonical sequence and the spare."""
    if not drafts:
        return 2
    return min(MAX_SEQUENCES, 2 + max_inflight * max(1, max_branches))


@dataclass(frozen=True)
class SlotGeometry:
    """One engine's sequences and cells, cut into `n_slots` equal request slots."""

    n_slots: int
    seqs_per_slot: int  # sequence ids of one slot (its request's `sequences_per_request`)
    cells_per_slot: int  # KV cells of one slot

    @classmethod
    def for_job(cls, n_ctx: int, parallel: int, max_inflight: int, max_branches: int, drafts: bool) -> SlotGeometry:
        """The geometry a job opens: all of --ctx for one slot, else each slot's share of it in
        whole SLOT_CELL_BLOCKs; a parallel server without a draft decodes iteratively only."""
        cells = n_ctx if parallel == 1 else n_ctx // parallel // SLOT_CELL_BLOCK * SLOT_CELL_BLOCK
        seqs = sequences_per_request(max_inflight, max_branches, drafts=drafts or parallel == 1)
        return cls(parallel, seqs, cells)

    @classmethod
    def of_engine(cls, n_seq_max: int, n_ctx: int, n_slots: int) -> SlotGeometry:
        """The slots of an opened engine (its sequences and cells shared out equally)."""
        return cls(n_slots, n_seq_max // n_slots, n_ctx // n_slots)

    @property
    def n_seq(self) -> int:
        """Sequence ids the engine opens: every slot's."""
        return self.seqs_per_slot * self.n_slots

    @property
    def n_ctx(self) -> int:
        """KV cells the engine opens: every slot's."""
        return self.cells_per_slot * self.n_slots

    @property
    def fits(self) -> bool:
        """Whether the slots' sequences fit the engine's MAX_SEQUENCES."""
        return self.n_seq <= MAX_SEQUENCES

    def engine_seq(self, slot: int, s: int) -> int:
        """The engine's sequence id of slot `slot`'s sequence `s` (ValueError outside the slot)."""
        if not 0 <= s < self.seqs_per_slot:
            raise ValueError(f"sequence {s} is outside slot {slot}'s {self.seqs_per_slot} sequences")
        return slot * self.seqs_per_slot + s

    def max_inflight_fitting(self, max_branches: int) -> int:
        """The largest --max-inflight whose slots would fit MAX_SEQUENCES (at least 1)."""
        return max(1, (MAX_SEQUENCES // self.n_slots - 2) // max(1, max_branches))
