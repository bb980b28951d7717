"""`pipeinfer` mode: continuous asynchronous speculation with early inference cancellation.

The head keeps several runs in flight down the pipeline at once:

- a single-token, non-speculative run from the last committed token whenever no valid run in
  flight starts there, so every verification yields at least one token;
- speculative runs that continue the draft's path beyond the runs already in flight, while the
  draft is confident (p >= p_accept + p_adjust) and sequence slots are free.

KV multibuffering: every run writes into its own sequence. At launch a run inherits its parent's
cells with one `seq_cp` (the parent is the previous run on its path, or the canonical sequence),
so it attends to the committed prefix and to the in-flight tokens it builds on. KV operations
travel in stream order behind the runs, so on each stage the parent has been computed before the
copy applies. Accepted tokens are committed with one `seq_cp(run → canonical)` over their
positions, and the run's sequence is dropped: O(1) messages per commit.

Results arrive in launch order. A run whose prefix turned out wrong is cancelled on every stage
directly (the stage drops it before starting or aborts it between layers) and its result, if any,
is ignored.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .metrics import now
from .pipeline import Pipeline
from .session import CANONICAL_SEQ, DecodeOptions, Session


@dataclass
class Flight:
    """A run in flight, as the head sees it."""

    run_id: int
    seq: int  # KV sequence the run writes into
    pos0: int  # position of its first input token
    tokens: list[int]  # input tokens, at positions pos0, pos0+1, …
    speculative: bool
    cancelled: bool = False

    @property
    def end(self) -> int:
        """Position just after its last input token."""
        return self.pos0 + len(self.tokens)


class SeqPool:
    """Free KV sequence ids (the canonical sequence 0 is never handed out)."""

    def __init__(self, n_seq_max: int):
        self.free = list(range(n_seq_max - 1, 0, -1))

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def release(self, seq: int) -> None:
        self.free.append(seq)


class PipeInfer:
    def __init__(self, pipe: Pipeline, s: Session, opts: DecodeOptions, drafter):
        self.pipe, self.s, self.opts, self.drafter = pipe, s, opts, drafter
        self.seqs = SeqPool(pipe.engine.n_seq_max)
        self.flights: deque[Flight] = deque()  # launch order, cancelled ones included until their result arrives
        self.runs_this_round = 0  # speculative runs launched since the last verification
        self.rejections = 0
        self.limit_pos = s.n_prompt + s.n_predict - 1  # last position whose token can still be committed

    # -- bookkeeping -------------------------------------------------------------------------
    def valid(self) -> list[Flight]:
        return [f for f in self.flights if not f.cancelled]

    def inflight(self) -> int:
        return len(self.valid())

    def path(self) -> list[int]:
        """Committed tokens followed by the inputs of the valid runs in flight (which start at the frontier - 1)."""
        toks = list(self.s.tokens)
        for f in self.valid():
            toks.extend(f.tokens[len(toks) - f.pos0:])
        return toks

    @property
    def p_adjust(self) -> float:
        return self.runs_this_round * self.opts.p_recovery - self.rejections * self.opts.p_decay

    # -- launching ---------------------------------------------------------------------------
    def launch(self, tokens: list[int], pos0: int, speculative: bool) -> bool:
        seq = self.seqs.take()
        if seq is None:
            return False
        valid = self.valid()
        parent = valid[-1].seq if valid else CANONICAL_SEQ
        self.pipe.seq_cp(parent, [seq])  # inherit the committed prefix and the in-flight path
        n = len(tokens)
        run_id = self.pipe.launch(tokens, list(range(pos0, pos0 + n)), [[seq]] * n, [True] * n, speculative=speculative)
        self.flights.append(Flight(run_id, seq, pos0, list(tokens), speculative))
        m = self.s.metrics.runs
        m.launched += 1
        m.speculative += speculative
        return True

    def ensure_frontier_run(self) -> None:
        """A non-speculative run from the last committed token, unless a valid run already starts there."""
        if not self.valid():
            self.launch([self.s.tokens[-1]], len(self.s.tokens) - 1, speculative=False)

    def speculate(self) -> bool:
        """Launch one speculative run continuing the path, if the draft is confident. True if launched."""
        if self.inflight() >= self.opts.max_inflight or not self.seqs.free:
            return False
        path = self.path()
        pos0 = len(path)  # position of the first drafted token
        n_max = min(self.opts.n_draft, self.limit_pos - pos0)
        if n_max <= 0:
            return False
        threshold = self.opts.p_accept + self.p_adjust
        t0 = now()
        prop = self.drafter.propose(path, n_max, threshold)
        self.pipe.trace.slice("draft", t0, now(), n_tokens=len(prop.tokens))
        keep = 0
        while keep < len(prop.tokens) and prop.probs[keep] >= threshold:
            keep += 1
        if keep == 0:
            return False
        self.runs_this_round += 1
        return self.launch(prop.tokens[:keep], pos0, speculative=True)

    # -- verification ------------------------------------------------------------------------
    def cancel_from(self, index: int) -> None:
        """Cancel every valid run from valid()[index] on: their paths contain a rejected token."""
        doomed = self.valid()[index:]
        if not doomed:
            return
        self.pipe.cancel([f.run_id for f in doomed])
        for f in doomed:
            f.cancelled = True
            # Stream order: this removal applies on each stage after the run passed (or was skipped).
            self.pipe.seq_rm(f.seq)
            self.seqs.release(f.seq)
        self.s.metrics.runs.cancelled += len(doomed)

    def verify(self, f: Flight, logits) -> None:
        s, acc = self.s, self.s.metrics.acceptance
        assert f.pos0 == len(s.tokens) - 1, "a valid run always starts at the last committed token"
        # Row i predicts position pos0+i+1; it is compared with the run's next input, if any.
        new: list[int] = []
        matched_all = True
        for i in range(len(f.tokens)):
            t = s.sample_at(logits[i], f.pos0 + i + 1)
            new.append(t)
            if i + 1 < len(f.tokens) and t != f.tokens[i + 1]:
                matched_all = False
                break
        # Commit the KV of the inputs that are now committed tokens, then drop the run's sequence.
        self.pipe.seq_cp(f.seq, [CANONICAL_SEQ], f.pos0, f.pos0 + len(new))
        self.pipe.seq_rm(f.seq)
        self.seqs.release(f.seq)
        taken = s.commit(new)
        self.pipe.trace.instant("commit", now(), run=f.run_id, n=taken)
        # Acceptance counts only comparisons whose row was committed (not those past an end of text).
        compared = len(new) - 1 if matched_all else len(new)
        counted = min(compared, taken)
        acc.drafted += counted
        acc.accepted += counted - (0 if matched_all or counted < compared else 1)
        if f.speculative:
            acc.verified_runs += 1
        rest = self.valid()
        if s.done:
            return
        if not matched_all:
            self.rejections += 1
            self.cancel_from(0)
        elif rest:
            # The next run's first input is a draft token at the new frontier - 1: check it now.
            acc.drafted += 1
            if rest[0].tokens[0] == s.tokens[-1] and rest[0].pos0 == len(s.tokens) - 1:
                acc.accepted += 1
            else:
                self.rejections += 1
                self.cancel_from(0)
        self.runs_this_round = 0

    def handle(self, res) -> None:
        f = self.flights.popleft()
        assert f.run_id == res.run_id, f"results arrive in launch order ({f.run_id} != {res.run_id})"
        if f.cancelled or res.logits is None or self.s.done:
            return
        self.verify(f, res.logits)

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        pipe = self.pipe
        while not self.s.done:
            pipe.poll()
            if pipe.ready:
                self.handle(pipe.ready.popleft())
                continue
            self.ensure_frontier_run()
            if self.speculate():
                continue  # check for results between drafts
            self.handle(pipe.next_result())
        self.drain()

    def drain(self) -> None:
        """Cancel what is left in flight and consume its results, so the stream is clean."""
        self.s.metrics.runs.cancelled_at_end += self.inflight()
        self.cancel_from(0)
        while self.flights:
            self.flights.popleft()
            self.pipe.next_result()


def decode_pipeinfer(pipe: Pipeline, s: Session, opts: DecodeOptions, drafter) -> None:
    PipeInfer(pipe, s, opts, drafter).run()
