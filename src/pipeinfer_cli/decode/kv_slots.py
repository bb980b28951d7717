"""KV sequence slots of the runs in flight, and the KV operations that go with them.

Every run (every branch of a tree) writes its own KV sequence. A slot is taken at launch, inherits
its parent's cells with one `seq_cp`, commits accepted positions into the canonical sequence with
one more, and is dropped with a `seq_rm` that travels in stream order behind the run.
"""

from __future__ import annotations

from typing import Protocol

from .session import CANONICAL_SEQ


class KvOps(Protocol):
    """The KV operations of a pipeline (applied here and, in stream order, on every stage)."""

    def seq_cp(self, src: int, dsts: list[int], p0: int = -1, p1: int = -1) -> None: ...

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None: ...


class KvSlots:
    """Free KV sequence ids (the canonical sequence is never handed out)."""

    def __init__(self, kv: KvOps, n_seq_max: int):
        self.kv = kv
        self.free = list(range(n_seq_max - 1, 0, -1))  # popped from the end: lowest id first

    @property
    def n_free(self) -> int:
        return len(self.free)

    def take(self, n: int) -> list[int]:
        """Up to n free sequence ids (fewer if the pool runs dry)."""
        out = []
        while len(out) < n and self.free:
            out.append(self.free.pop())
        return out

    def inherit(self, parent: int, seqs: list[int]) -> None:
        """Give new sequences the parent's cells (the committed prefix and the path in flight)."""
        self.kv.seq_cp(parent, seqs)

    def commit(self, seq: int, p0: int, p1: int) -> None:
        """Copy a run's cells at positions [p0, p1) into the canonical sequence."""
        self.kv.seq_cp(seq, [CANONICAL_SEQ], p0, p1)

    def drop(self, seq: int) -> None:
        """Remove a sequence's cells (after the runs already sent, in stream order) and free its slot."""
        self.kv.seq_rm(seq)
        self.free.append(seq)
