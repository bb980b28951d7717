"""`pipeinfer` mode: continuous asynchronous speculation with early inference cancellation.

The head keeps several runs in flight down the pipeline at once:

- a single-token, non-speculative run from the last committed token whenever no valid run in
  flight starts there, so every verification yields at least one token;
- speculative runs that continue the draft's path beyond the runs already in flight, while the
  draft is confident (p >= p_accept + p_adjust), sequence slots are free, and a token that far
  ahead is worth drafting (`draft_budget.py`).

KV multibuffering (`kv_slots.py`): every run writes into its own sequence. At launch a run
inherits its parent's cells with one `seq_cp` (the parent is the previous run on its path, or the
canonical sequence), so it attends to the committed prefix and to the in-flight tokens it builds
on. KV operations travel in stream order behind the runs, so on each stage the parent has been
computed before the copy applies. Accepted tokens are committed with one `seq_cp(run → canonical)`
over their positions, and the run's sequence is dropped: O(1) messages per commit.

Token trees (`--max-branches B > 1`; layout and walk in `tree.py`, where a draft splits in
`side_branches.py`): a speculative run may carry up to B branches, one KV sequence each. Later runs
continue one branch (`Flight.parent = (run_id, branch)`) and stay valid only if that very branch
won: equal tokens on another branch attended to another KV context. When the previous run decides
a tree's first token, the branches that start with a wrong token are dropped at once (`seq_rm` in
stream order, slot freed) while the run goes on.

Asynchronous drafting with a draft rank: `async_draft.py`. Drafters on the head are synchronous.

Results arrive in launch order. A run whose prefix turned out wrong is cancelled on every stage
directly (the stage drops it before starting or aborts it between layers); its result is ignored.

The policy sees the pipeline only through `PipelineLike` and time only through the clock and the
`wait_until` it is given, so it runs as well against a simulated pipeline as against MPI ranks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from .async_draft import AsyncDraft
from .draft_budget import DraftBudget
from .draft_economy import PROBE_CONTEXT, DraftMemory
from .draft_gate import draft_gate
from .drafters import AsyncDrafter, Drafter
from .kv_slots import KvSlots
from .metrics import now
from .pipeline_protocol import PipelineLike, may_speculate
from .session import CANONICAL_SEQ, DecodeOptions, Session
from .side_branches import side_branches
from .tree import Branch, Flight, confident, tree_batch, walk_tree


class PipeInfer:
    """The speculation policy of one request: what to launch, what to cancel, what to commit.

    clock: the time for trace events. wait_until(cond): return once cond() is true (cond polls the
    pipeline and the draft rank); how to wait is the pipeline's business (`Pipeline.wait_until`).
    prompt_pass: the draft model's pass over the prompt, not run yet: on one stage it runs only once
    a probe says drafting may pay (draft_economy.py); elsewhere at once. memory: the job's
    `DraftMemory`.
    """

    def __init__(self, pipe: PipelineLike, s: Session, opts: DecodeOptions, drafter: Drafter | AsyncDrafter, *,
                 wait_until: Callable[[Callable[[], bool]], None], clock: Callable[[], float] = now,
                 prompt_pass: Callable[[], None] | None = None, memory: DraftMemory | None = None):
        self.pipe, self.s, self.opts, self.drafter = pipe, s, opts, drafter
        self.wait_until, self.clock = wait_until, clock
        self.slots = KvSlots(pipe, pipe.engine.n_seq_max)
        self.flights: deque[Flight] = deque()  # launch order, cancelled ones included until their result arrives
        self.runs_this_round = 0  # speculative runs launched since the last verification
        self.draft_source: str | None = None  # Proposal.source of the last synchronous draft
        self.rejections = 0
        self.limit_pos = s.n_prompt + s.n_predict - 1  # last position whose token can still be committed
        # A dedicated draft rank answers asynchronously (request/poll); head-local drafters are synchronous.
        self.draft = AsyncDraft(drafter, opts.n_draft) if isinstance(drafter, AsyncDrafter) else None
        # One stage, drafter on the head: drafting takes the cores the next token would (draft_gate.py).
        self.gate = draft_gate(opts.spec_policy, self.draft is None and pipe.n_stages == 1, drafter,
                               memory if memory is not None else DraftMemory(), prompt_pass)
        self.budget = DraftBudget(opts.p_reach)  # how far ahead to draft: acceptance, timings

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

    @property
    def threshold(self) -> float:
        return self.opts.p_accept + self.p_adjust

    def can_speculate(self) -> bool:
        """Room for a speculative run (the load policy of a pipeline shared by requests, too)."""
        return self.inflight() < self.opts.max_inflight and self.slots.n_free > 0 and may_speculate(self.pipe)

    def draft_window(self, path: list[int]) -> int:
        """How many tokens a draft continuing `path` may propose: up to --n-draft, never past -n,
        nor further ahead of the committed tokens than the measured acceptance makes worth it."""
        return min(self.opts.n_draft, self.limit_pos - len(path), self.budget.room(len(path) - len(self.s.tokens)))

    # -- launching ---------------------------------------------------------------------------
    def launch(self, branch_tokens: list[list[int]], pos0: int, speculative: bool, source: str | None = None) -> bool:
        """Launch one run: a single path, or a tree of paths that share a prefix and split once.

        branch_tokens[b] is branch b's full input (from pos0); branch 0 is the one later runs continue.
        Branches beyond the free slots are left out. False if no slot was free.
        """
        seqs = self.slots.take(len(branch_tokens))
        if not seqs:
            return False
        valid = self.valid()
        parent = (valid[-1].run_id, valid[-1].follow) if valid else None
        # Inherit the committed prefix and the in-flight path, into every branch at once.
        self.slots.inherit(valid[-1].seq if valid else CANONICAL_SEQ, seqs)
        batch = tree_batch(branch_tokens[:len(seqs)], seqs, pos0)
        t0 = self.clock()
        run_id = self.pipe.launch(batch.tokens, batch.pos, batch.seq_ids, batch.output, speculative=speculative)
        n = len(batch.tokens)
        self.gate.launched(speculative, n, self.clock() - t0)
        self.budget.head_run(n, self.clock() - t0)
        self.flights.append(Flight(run_id, pos0, batch.branches, speculative, parent, n_cells=n, source=source,
                                   t_launch=t0))
        m = self.s.metrics.runs
        m.launched += 1
        m.speculative += speculative
        m.branches_launched += len(batch.branches) - 1
        if speculative:  # its rows past the committed tokens are drafted ones
            self.s.metrics.drafting.launched += sum(1 for p in batch.pos if p >= len(self.s.tokens))
        return True

    def ensure_frontier_run(self) -> None:
        """A non-speculative run from the last committed token, unless a valid run already starts there."""
        if not self.valid():
            self.launch([[self.s.tokens[-1]]], len(self.s.tokens) - 1, speculative=False)

    def speculate(self) -> bool:
        """Launch one speculative run continuing the path, if the draft is confident. True if launched."""
        if not self.can_speculate():
            return False
        path = self.path()
        n_max = self.draft_window(path)
        if n_max <= 0:
            return False
        if not self.gate.may_draft():
            return False
        if self.gate.probe:
            branches, t0 = self.probe_draft(path, n_max)
        else:
            t0 = self.clock()
            branches = self.draft_tree(path, n_max, self.threshold)
        t1 = self.clock()
        self.pipe.trace.slice("draft", t0, t1, n_tokens=sum(len(b) for b in branches), branches=len(branches))
        self.gate.drafted(t1 - t0)
        self.budget.drafted(sum(len(b) for b in branches), t1 - t0)
        if not branches[0]:
            return False
        self.runs_this_round += 1
        return self.launch(branches, len(path), speculative=True, source=self.draft_source)

    def probe_draft(self, path: list[int], n_max: int) -> tuple[list[list[int]], float]:
        """The first draft of a request whose draft model has not read the prompt: n_max tokens from
        the last PROBE_CONTEXT tokens of the path, whatever their confidence, so that its run
        measures what drafting and verifying n_max tokens cost. The drafting is timed from after the
        draft read that context (returned with the branch)."""
        tail = path[-PROBE_CONTEXT:]
        self.drafter.read_context(tail[:-1])
        self.gate.probed()
        t0 = self.clock()
        prop = self.drafter.propose(tail, n_max, 0.0)
        self.draft_source = prop.source
        self.s.metrics.drafting.proposed += len(prop.tokens)
        return [prop.tokens], t0

    def draft_tree(self, path: list[int], n_max: int, threshold: float) -> list[list[int]]:
        """The confident part of the draft continuing `path`, then the side branches a tree may add."""
        prop = self.drafter.propose(path, n_max, threshold)
        self.draft_source = prop.source
        self.s.metrics.drafting.proposed += len(prop.tokens)
        keep = confident(prop.probs, threshold)
        branches = [prop.tokens[:keep]]
        budget = min(self.opts.max_branches, self.slots.n_free) - 1
        if keep and budget > 0:
            side = side_branches(self.drafter, path, prop, keep, n_max, threshold, self.opts.p_split, budget,
                                 self.s.metrics.drafting)
            # A tree takes more KV cells than --ctx was checked for (n_draft per run in flight): keep
            # the side branches only while the cache has room for them.
            room = (self.pipe.engine.n_ctx - len(self.s.tokens) - sum(f.n_cells for f in self.valid())
                    - self.opts.n_draft)
            while side and keep + sum(len(b) for b in side) > room:
                side.pop()
            branches += side
        return branches

    # -- asynchronous drafting (dedicated draft rank) -----------------------------------------
    def request_draft(self, ahead: list[int] | None = None) -> None:
        """Keep one draft request outstanding, for the path beyond the runs in flight.

        ahead: tokens of a run about to be launched. The request goes out before the launch, since
        the head computes its own layers inside `launch`: the draft rank drafts meanwhile.
        """
        if self.draft.busy:
            return
        path = self.path() + (ahead or [])
        self.draft.request(path, self.limit_pos - len(path), self.budget.room(len(path) - len(self.s.tokens)))

    def launch_reply(self) -> bool:
        """Launch the pending draft reply if it still continues the current path, else what a free
        drafter in front of the draft rank offers (hybrid's lookup or suffix drafter, asked at every
        step while the draft rank drafts: it costs nothing). True if something changed."""
        free = getattr(self.drafter, "free_draft", None)
        if (self.draft.reply is None and free is None) or not self.can_speculate():
            return False
        path, draft = self.path(), None
        if self.draft_window(path) <= 0:
            return False  # enough in flight for now: the reply waits for room
        if self.draft.reply is not None:
            source = self.draft.reply.source
            draft = self.draft.take(path, self.threshold, self.draft_window(path))
            if draft == []:
                return True  # dropped: ask again
        if not draft and free is not None:
            draft, source = free(path, self.threshold, self.draft_window(path)), self.drafter.front_name
            self.s.metrics.drafting.proposed += len(draft or [])
        if not draft:
            return False
        self.request_draft(ahead=draft)  # draft beyond this run while the head computes it
        # Nothing in flight: the run starts with the last committed token (not in the KV yet), as a
        # speculative run of the synchronous scheme does; no separate frontier run needed.
        first = [] if self.valid() else [self.s.tokens[-1]]
        ok = self.launch([first + draft], len(path) - len(first), speculative=True, source=source)
        self.runs_this_round += ok
        return ok

    def wait_any(self) -> None:
        """Wait until a result or a draft reply has arrived."""
        self.wait_until(lambda: bool(self.pipe.poll() or self.pipe.ready) or self.draft.arrived())

    # -- verification ------------------------------------------------------------------------
    def kill(self, f: Flight, branches: list[Branch]) -> None:
        """Remove branches of a flight from the KV (in stream order) and free their slots."""
        for b in branches:
            b.alive = False
            self.slots.drop(b.seq)

    def cancel_from(self, index: int) -> None:
        """Cancel every valid run from valid()[index] on: their paths contain a rejected token."""
        doomed = self.valid()[index:]
        if not doomed:
            return
        self.pipe.cancel([f.run_id for f in doomed])
        for f in doomed:
            f.cancelled = True
            self.kill(f, f.alive())
        self.s.metrics.runs.cancelled += len(doomed)

    def prune(self, f: Flight, ok: list[int]) -> None:
        """Per-branch cancellation: f (= valid()[0]) stays useful through branches `ok`; drop the others now.

        The native engine cannot drop rows of a batch it is already computing, and a run already
        sent down the pipe keeps its rows on every stage: the dead branch's rows are still computed
        (or skipped with the whole run only if it is cancelled). What is saved is its sequence slot,
        freed for new runs at once, and its KV cells, removed by a `seq_rm` that follows the run in
        stream order.
        """
        dead = [k for k, b in enumerate(f.branches) if b.alive and k not in ok]
        self.kill(f, [f.branches[k] for k in dead])
        self.s.metrics.runs.branches_cancelled += len(dead)
        if f.follow in dead:
            # Later runs continue the dead branch: their KV context is wrong, whatever their tokens.
            self.cancel_from(1)
            f.follow = ok[0]

    def verify(self, f: Flight, sampled) -> None:
        s, acc = self.s, self.s.metrics.acceptance
        assert f.pos0 == len(s.tokens) - 1, "a valid run always starts at the last committed token"
        walk = walk_tree(f.branches, lambda row, i: int(sampled[row]))
        taken = s.commit(walk.tokens)
        # Commit the KV of the inputs that are now committed tokens (through the winning branch's
        # sequence; none past an end of text), then drop every branch's sequence.
        self.slots.commit(f.branches[walk.winner].seq, f.pos0, f.pos0 + taken)
        self.kill(f, f.alive())
        self.pipe.trace.instant("commit", self.clock(), run=f.run_id, n=taken, branch=walk.winner)
        drafted, accepted = walk.acceptance(taken)
        acc.add(drafted, accepted, f.source)
        self.budget.observe(drafted, accepted)
        if f.speculative and f.parent is None:
            # A speculative run launched with nothing in flight starts with the last committed token
            # (a draft rank's reply): its drafted tokens were all checked here.
            acc.verified_runs += 1
        if s.done:
            return
        if not walk.matched_all:
            self.reject()
        elif self.valid():
            self.check_next(f.run_id, walk.winner)
        self.runs_this_round = 0

    def reject(self) -> None:
        """The path in flight is wrong from the oldest valid run on."""
        self.rejections += 1
        self.cancel_from(0)

    def check_next(self, run_id: int, winner: int) -> None:
        """The next run's first input is a draft token at the new frontier - 1: check it now.

        run_id, winner: the run just verified and its winning branch, which the next run must continue.
        """
        s, acc = self.s, self.s.metrics.acceptance
        nxt = self.valid()[0]
        # A speculative run's verification starts here, with its first (drafted) token; count it
        # even if that token is rejected, so mean_accepted_len is per verified run as defined.
        acc.verified_runs += nxt.speculative
        ok = [k for k, b in enumerate(nxt.branches)
              if b.alive and b.tokens[0] == s.tokens[-1] and nxt.pos0 == len(s.tokens) - 1]
        if nxt.parent == (run_id, winner) and ok:
            acc.add(1, 1, nxt.source)
            self.budget.observe(1, 1)
            self.prune(nxt, ok)
        else:
            acc.add(1, 0, nxt.source)
            self.budget.observe(1, 0)
            self.reject()

    def handle(self, res) -> None:
        f = self.flights.popleft()
        assert f.run_id == res.run_id, f"results arrive in launch order ({f.run_id} != {res.run_id})"
        if f.cancelled or res.tokens is None or self.s.done:
            return
        if not f.speculative and f.n_cells == 1:
            self.budget.single_pass(self.clock() - f.t_launch)
        accepted = self.s.metrics.acceptance.accepted
        self.verify(f, res.tokens)
        self.gate.accepted(self.s.metrics.acceptance.accepted - accepted)

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        if self.draft is not None:
            self.run_async()
        else:
            self.run_sync()
        self.drain()
        self.gate.report(self.s.metrics.runs)

    def handle_arrived(self) -> bool:
        """Verify the oldest result if one has arrived, without waiting. True if one was handled."""
        self.pipe.poll()
        if not self.pipe.ready:
            return False
        self.handle(self.pipe.ready.popleft())
        return True

    def run_sync(self) -> None:
        while not self.s.done:
            if self.handle_arrived():
                continue
            self.ensure_frontier_run()
            if self.speculate():
                continue  # check for results between drafts
            self.handle(self.pipe.next_result())

    def run_async(self) -> None:
        """The draft rank drafts while the head computes, verifies and launches."""
        while not self.s.done:
            if self.handle_arrived():
                continue
            self.s.metrics.drafting.proposed += self.draft.receive(self.path)
            if self.launch_reply():
                continue
            self.request_draft()
            self.ensure_frontier_run()
            if self.pipe.ready:
                continue  # one stage: the run was computed on the spot
            self.wait_any()

    def drain(self) -> None:
        """Cancel what is left in flight and consume its results (and any draft reply), so the streams are clean."""
        self.s.metrics.runs.cancelled_at_end += self.inflight()
        self.cancel_from(0)
        while self.flights:
            self.flights.popleft()
            self.pipe.next_result()
        if self.draft is not None:
            self.s.metrics.drafting.proposed += self.draft.drain()


def decode_pipeinfer(pipe: PipelineLike, s: Session, opts: DecodeOptions, drafter: Drafter | AsyncDrafter,
                     prompt_pass: Callable[[], None] | None = None, memory: DraftMemory | None = None) -> None:
    # A simulated pipeline keeps virtual time (`clock`); the real one runs on the wall clock.
    PipeInfer(pipe, s, opts, drafter, wait_until=pipe.wait_until, clock=getattr(pipe, "clock", now),
              prompt_pass=prompt_pass, memory=memory).run()
