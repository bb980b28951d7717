"""A pipeline without MPI or a model: the `PipelineLike` that tests (and a planner) run the real
decoding policies against.

It keeps a KV cache of cells (position, token, sequences) with llama.cpp's `seq_cp`/`seq_rm`
semantics, so a policy's wrong KV operation shows: a row whose sequence lacks a position, or holds
two cells for one position, raises. Its target is any function from the tokens a row attends to
onto logits, sampled as the last stage samples (so a row's token is a function of its prefix).
Results come back at launch (one stage, latency 0) or `latency` polls later (runs in flight).
Every launch, KV operation and cancel is logged for tests to read (`ops`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np

from .pipeline_protocol import RunResult
from .sampling import SamplingParams, sample
from .trace import TraceRecorder

Logits = Callable[[tuple[int, ...]], np.ndarray]  # the tokens a row attends to -> its logits


class VirtualPipeline:
    """A PipelineLike whose target is `logits_of`, with a cell-level KV cache and a latency in polls."""

    def __init__(self, logits_of: Logits, latency: int = 0, n_seq_max: int = 10, n_ctx: int = 512):
        self.logits_of = logits_of
        self.n_stages = 1 if latency == 0 else 2
        self.latency = latency
        self.engine = SimpleNamespace(n_seq_max=n_seq_max, n_ctx=n_ctx)
        self.trace = TraceRecorder(0)
        self.ready: deque[RunResult] = deque()
        self.cells: list[list] = []  # [pos, token, set of seqs]
        self.pending: deque = deque()  # (due tick, run_id, sampled tokens)
        self.cancelled: set[int] = set()
        self.tick = 0
        self.next_run_id = 1
        self.log: list[tuple] = []
        self.sampling = SamplingParams()

    def set_sampling(self, params: SamplingParams) -> None:
        self.sampling = params

    # -- KV ----------------------------------------------------------------------------------
    def context(self, seq: int, pos: int) -> tuple[int, ...]:
        """Tokens the row at `pos` of `seq` attends to: exactly one cell per position 0..pos."""
        by_pos: dict[int, list[int]] = {}
        for p, t, seqs in self.cells:
            if seq in seqs and p <= pos:
                by_pos.setdefault(p, []).append(t)
        if sorted(by_pos) != list(range(pos + 1)):
            raise AssertionError(f"seq {seq} lacks positions before {pos}")
        if any(len(v) != 1 for v in by_pos.values()):
            raise AssertionError(f"seq {seq} has two cells for one position")
        return tuple(by_pos[p][0] for p in range(pos + 1))

    def seq_cp(self, src: int, dsts: list[int], p0: int = -1, p1: int = -1) -> None:
        self.log.append(("seq_cp", src, list(dsts), p0, p1))
        for c in self.cells:
            if src in c[2] and (p0 < 0 or c[0] >= p0) and (p1 < 0 or c[0] < p1):
                c[2] |= set(dsts)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        self.log.append(("seq_rm", seq, p0, p1))
        for c in self.cells:
            if (p0 < 0 or c[0] >= p0) and (p1 < 0 or c[0] < p1):
                c[2].discard(seq)
        self.cells = [c for c in self.cells if c[2]]

    def kv_used_cells(self) -> int:
        return len(self.cells)

    # -- runs --------------------------------------------------------------------------------
    def launch(self, tokens: list[int], pos: list[int], seq_ids: list[list[int]], output: list[bool],
               speculative: bool = False, invariant: bool = True) -> int:
        run_id = self.next_run_id
        self.next_run_id += 1
        self.log.append(("launch", run_id, list(tokens), list(pos), [list(s) for s in seq_ids], speculative))
        rows = []
        for t, p, sids, out in zip(tokens, pos, seq_ids, output):
            self.cells.append([p, t, set(sids)])
            if out:  # the last stage samples: only the token ids come back
                rows.append(self.row_token(self.context(sids[0], p), p))
        sampled = np.asarray(rows, np.int64)
        if self.latency == 0:
            self.ready.append(RunResult(run_id, sampled))
        else:
            self.pending.append((self.tick + self.latency, run_id, sampled))
        return run_id

    def row_token(self, context: tuple[int, ...], pos: int) -> int:
        """The token the last stage samples after a row at `pos` that attends to `context`."""
        return sample(self.logits_of(context), self.sampling, pos + 1)

    def cancel(self, run_ids: list[int]) -> None:
        self.log.append(("cancel", list(run_ids)))
        self.cancelled |= set(run_ids)

    def poll(self) -> bool:
        if self.latency == 0:
            return bool(self.ready)
        self.tick += 1
        got = False
        while self.pending and self.pending[0][0] <= self.tick:
            _, run_id, sampled = self.pending.popleft()
            self.ready.append(RunResult(run_id, None if run_id in self.cancelled else sampled))
            got = True
        return got

    def next_result(self) -> RunResult:
        while not self.ready:
            self.poll()
        return self.ready.popleft()

    def wait_until(self, cond: Callable[[], bool], max_checks: int = 10_000) -> None:
        """Until cond() is true; cond polls what it waits for (each poll is one tick), as with the
        real pipeline. A policy that would wait for ever raises instead."""
        for _ in range(max_checks):
            if cond():
                return
        raise AssertionError(f"cond() was still false after {max_checks} checks: the policy would wait for ever")

    def ops(self, kind: str) -> list[tuple]:
        """The logged operations of one kind ("launch", "seq_cp", "seq_rm", "cancel"), without it."""
        return [op[1:] for op in self.log if op[0] == kind]
