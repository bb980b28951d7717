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

Token trees (`--max-branches B > 1`): a speculative run may carry up to B branches, one KV
sequence each. The tree is narrow and deep: at most one split point per run, at the first drafted
position where a runner-up candidate has p > p_split; each side branch takes that runner-up and
continues by greedy drafting from it. The tokens before the split belong to every branch's
sequence in the one batch (seq_ids=[s1, s2, ...]); the parent's cells are copied to all branch
sequences with one `seq_cp` to many. Verification walks the tree from its first node, following
the child whose token equals the target's sample, and keeps the longest matching branch; the
commit goes through the winning branch's sequence. Later runs continue one branch of a tree run
(`Flight.parent = (run_id, branch)`) and stay valid only if that very branch won: equal tokens on
another branch are not enough, because their KV context (what they attended to) would differ.

Per-branch cancellation: when the previous run's verification decides a tree run's first token
(its split is at position 0), the branches that start with a wrong token die at once: their
sequence is removed with a `seq_rm` in stream order and the slot is freed, while the run goes on.

Asynchronous drafting (`--layer-split …/1`, a dedicated draft rank): the head keeps one draft
request outstanding for the path beyond the runs in flight, and verifies results while the draft
rank drafts. A reply is launched only if the path it continues is still consistent with the
current path (the current path is a prefix of the reply's path + draft); otherwise it is dropped
and the head asks again. Drafters on the head itself stay synchronous.

Results arrive in launch order. A run whose prefix turned out wrong is cancelled on every stage
directly (the stage drops it before starting or aborts it between layers) and its result, if any,
is ignored.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..transport.mpi_link import Backoff
from .drafters import Proposal
from .metrics import now
from .pipeline import Pipeline
from .session import CANONICAL_SEQ, DecodeOptions, Session


@dataclass
class Branch:
    """One path of a run (a plain run has exactly one)."""

    seq: int  # KV sequence the branch writes into
    tokens: list[int]  # its input tokens at positions pos0, pos0+1, … (the shared prefix included)
    rows: list[int]  # batch row (= logits row) of each of those tokens
    alive: bool = True


@dataclass
class Flight:
    """A run in flight, as the head sees it."""

    run_id: int
    pos0: int  # position of its first input token
    branches: list[Branch]
    speculative: bool
    parent: tuple[int, int] | None = None  # (run_id, branch) it continues; None = the canonical sequence
    follow: int = 0  # the branch later runs continue
    cancelled: bool = False
    n_cells: int = 0  # rows of its batch (KV cells it takes on each stage)

    @property
    def tokens(self) -> list[int]:
        return self.branches[self.follow].tokens

    @property
    def seq(self) -> int:
        return self.branches[self.follow].seq

    @property
    def end(self) -> int:
        """Position just after the last input token of the followed branch."""
        return self.pos0 + len(self.tokens)

    def alive(self) -> list[Branch]:
        return [b for b in self.branches if b.alive]


class SeqPool:
    """Free KV sequence ids (the canonical sequence 0 is never handed out)."""

    def __init__(self, n_seq_max: int):
        self.free = list(range(n_seq_max - 1, 0, -1))

    def take(self) -> int | None:
        return self.free.pop() if self.free else None

    def release(self, seq: int) -> None:
        self.free.append(seq)


@dataclass
class _Reply:
    """A draft rank's answer: the path it continues and its proposal."""

    path: list[int]
    prop: Proposal
    seen: list[int] = field(default_factory=list)  # path at which it was found not launchable (low confidence)


class PipeInfer:
    def __init__(self, pipe: Pipeline, s: Session, opts: DecodeOptions, drafter):
        self.pipe, self.s, self.opts, self.drafter = pipe, s, opts, drafter
        self.seqs = SeqPool(pipe.engine.n_seq_max)
        self.flights: deque[Flight] = deque()  # launch order, cancelled ones included until their result arrives
        self.runs_this_round = 0  # speculative runs launched since the last verification
        self.rejections = 0
        self.limit_pos = s.n_prompt + s.n_predict - 1  # last position whose token can still be committed
        # A dedicated draft rank answers asynchronously (request/poll); head-local drafters are synchronous.
        self.remote = bool(getattr(drafter, "asynchronous", False))
        self.reply: _Reply | None = None  # a draft reply not launched yet
        self.refused: list[int] | None = None  # path whose draft was not confident enough: do not ask again
        self.lag = 0  # tokens the path advanced during the last draft round trip

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
        return self.inflight() < self.opts.max_inflight and bool(self.seqs.free)

    # -- launching ---------------------------------------------------------------------------
    def launch(self, branch_tokens: list[list[int]], pos0: int, speculative: bool) -> bool:
        """Launch one run: a single path, or a tree of paths that share a prefix and split once.

        branch_tokens[b] is branch b's full input (from pos0); branch 0 is the one later runs continue.
        """
        seqs: list[int] = []
        for _ in branch_tokens:
            seq = self.seqs.take()
            if seq is None:
                break
            seqs.append(seq)
        if not seqs:
            return False
        branch_tokens = branch_tokens[:len(seqs)]
        valid = self.valid()
        parent = (valid[-1].run_id, valid[-1].follow) if valid else None
        # Inherit the committed prefix and the in-flight path, into every branch at once.
        self.pipe.seq_cp(valid[-1].seq if valid else CANONICAL_SEQ, seqs)
        # Shared prefix: one row per token, belonging to every branch's sequence.
        shared = 0
        first = branch_tokens[0]
        while shared < len(first) and all(len(bt) > shared and bt[shared] == first[shared] for bt in branch_tokens):
            shared += 1
        if len(branch_tokens) == 1:
            shared = len(first)
        toks, pos, sids = list(first[:shared]), list(range(pos0, pos0 + shared)), [list(seqs)] * shared
        branches = []
        for bt, seq in zip(branch_tokens, seqs):
            rows = list(range(shared))
            for i in range(shared, len(bt)):
                rows.append(len(toks))
                toks.append(bt[i])
                pos.append(pos0 + i)
                sids.append([seq])
            branches.append(Branch(seq, list(bt), rows))
        n = len(toks)
        run_id = self.pipe.launch(toks, pos, sids, [True] * n, speculative=speculative)
        self.flights.append(Flight(run_id, pos0, branches, speculative, parent, n_cells=n))
        m = self.s.metrics.runs
        m.launched += 1
        m.speculative += speculative
        m.branches_launched += len(branches) - 1
        return True

    def ensure_frontier_run(self) -> None:
        """A non-speculative run from the last committed token, unless a valid run already starts there."""
        if not self.valid():
            self.launch([[self.s.tokens[-1]]], len(self.s.tokens) - 1, speculative=False)

    def draft_window(self, path: list[int]) -> int:
        """How many tokens a draft continuing `path` may propose."""
        return min(self.opts.n_draft, self.limit_pos - len(path))

    def speculate(self) -> bool:
        """Launch one speculative run continuing the path, if the draft is confident. True if launched."""
        if not self.can_speculate():
            return False
        path = self.path()
        pos0 = len(path)  # position of the first drafted token
        n_max = self.draft_window(path)
        if n_max <= 0:
            return False
        threshold = self.threshold
        t0 = now()
        prop = self.drafter.propose(path, n_max, threshold)
        keep = _confident(prop.probs, threshold)
        branches = [prop.tokens[:keep]]
        budget = min(self.opts.max_branches, len(self.seqs.free)) - 1
        if keep and budget > 0:
            side = self.side_branches(path, prop, keep, n_max, threshold, budget)
            # A tree takes more KV cells than --ctx was checked for (n_draft per run in flight): keep
            # the side branches only while the cache has room for them.
            room = self.pipe.engine.n_ctx - len(self.s.tokens) - sum(f.n_cells for f in self.valid()) - self.opts.n_draft
            while side and keep + sum(len(b) for b in side) > room:
                side.pop()
            branches += side
        self.pipe.trace.slice("draft", t0, now(), n_tokens=sum(len(b) for b in branches), branches=len(branches))
        if keep == 0:
            return False
        self.runs_this_round += 1
        return self.launch(branches, pos0, speculative=True)

    def side_branches(self, path: list[int], prop: Proposal, keep: int, n_max: int, threshold: float,
                      budget: int) -> list[list[int]]:
        """Narrow, deep tree: split once, at the first kept position whose runner-ups beat p_split.

        Each side branch takes one of those runner-ups and continues by greedy drafting from it
        (a drafter can continue any path). Drafters without alternatives (lookup) never split.
        """
        for j in range(keep):
            alts = [t for t, p in prop.alternatives[j] if p > self.opts.p_split][:budget] if j < len(prop.alternatives) else []
            if alts:
                break
        else:
            return []
        out = []
        for a in alts:
            stem = prop.tokens[:j] + [a]
            cont = self.drafter.propose(path + stem, n_max - len(stem), threshold) if n_max > len(stem) else None
            out.append(stem + (cont.tokens[:_confident(cont.probs, threshold)] if cont else []))
        return out

    # -- asynchronous drafting (dedicated draft rank) -----------------------------------------
    def request_draft(self, ahead: list[int] | None = None) -> None:
        """Keep one draft request outstanding, for the path beyond the runs in flight.

        ahead: tokens of a run about to be launched. The request goes out before the launch, since
        the head computes its own layers inside `launch`: the draft rank drafts meanwhile.
        """
        if self.drafter.outstanding or self.reply is not None:
            return
        path = self.path() + (ahead or [])
        if self.draft_window(path) <= 0 or path == self.refused:
            return
        # The path keeps moving while the draft rank drafts (the head decodes on): ask for as many
        # more tokens as it moved during the last round trip, so the reply still reaches ahead, and
        # with no confidence cutoff: the head applies p_accept + p_adjust to the part it launches
        # (the tokens the path has meanwhile committed need no confidence). Measured on qwen-coder
        # (1/1 and 0.5,0.5/1): a few % faster than cutting the draft short at the draft rank.
        n_max = min(self.opts.n_draft + self.lag, self.limit_pos - len(path))
        self.drafter.request(path, n_max, 0.0)

    def poll_draft(self) -> None:
        if self.reply is None and self.drafter.outstanding:
            prop = self.drafter.poll()
            if prop is not None:
                self.reply = _Reply(prop.base, prop)
                self.lag = min(max(len(self.path()) - len(prop.base), 0), 2 * self.opts.n_draft)

    def launch_reply(self) -> bool:
        """Launch the pending draft reply if it still continues the current path. True if something changed."""
        r = self.reply
        if r is None or not self.can_speculate():
            return False
        path = self.path()
        if path == r.seen:
            return False  # already judged at this path (not confident enough); wait for a change
        cand = r.path + r.prop.tokens
        probs = [1.0] * len(r.path) + r.prop.probs
        if len(cand) <= len(path) or cand[:len(path)] != path:
            # The path moved on in another direction (a rejection), or past the whole draft: ask again.
            self.reply = None
            return True
        rest, rest_p = cand[len(path):], probs[len(path):]
        n_max = self.draft_window(path)
        keep = min(_confident(rest_p, self.threshold), max(n_max, 0))
        if keep == 0:
            # Not confident enough now; keep it in case the path advances into it, and do not ask for this path again.
            r.seen = path
            self.refused = path
            return False
        self.reply = None
        draft = rest[:keep]
        self.request_draft(ahead=draft)  # draft beyond this run while the head computes it
        if self.valid():
            ok = self.launch([draft], len(path), speculative=True)
        else:
            # Nothing in flight: the run starts with the last committed token (not in the KV yet),
            # as a speculative run of the synchronous scheme does; no separate frontier run needed.
            ok = self.launch([[self.s.tokens[-1]] + draft], len(self.s.tokens) - 1, speculative=True)
        if ok:
            self.runs_this_round += 1
        return ok

    def wait_any(self) -> None:
        """Sleep (with backoff, never spinning) until a result or a draft reply has arrived."""
        from .remote_draft import raise_reported_error

        backoff = Backoff()
        while True:
            if self.pipe.poll() or self.pipe.ready:
                return
            if self.drafter.outstanding and self.drafter.ready():
                return
            if self.pipe.link is not None:
                raise_reported_error(self.pipe.link)
                self.pipe.link.progress_sends()
            backoff.idle()

    # -- verification ------------------------------------------------------------------------
    def drop(self, f: Flight) -> None:
        """Remove a flight's live branches from the KV (stream order) and free their slots."""
        for b in f.alive():
            b.alive = False
            # Stream order: this removal applies on each stage after the run passed (or was skipped).
            self.pipe.seq_rm(b.seq)
            self.seqs.release(b.seq)

    def cancel_from(self, index: int) -> None:
        """Cancel every valid run from valid()[index] on: their paths contain a rejected token."""
        doomed = self.valid()[index:]
        if not doomed:
            return
        self.pipe.cancel([f.run_id for f in doomed])
        for f in doomed:
            f.cancelled = True
            self.drop(f)
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
        for k in dead:
            b = f.branches[k]
            b.alive = False
            self.pipe.seq_rm(b.seq)
            self.seqs.release(b.seq)
        self.s.metrics.runs.branches_cancelled += len(dead)
        if f.follow in dead:
            # Later runs continue the dead branch: their KV context is wrong, whatever their tokens.
            self.cancel_from(1)
            f.follow = ok[0]

    def verify(self, f: Flight, logits) -> None:
        s, acc = self.s, self.s.metrics.acceptance
        assert f.pos0 == len(s.tokens) - 1, "a valid run always starts at the last committed token"
        # Walk the tree from its first node: row i predicts position pos0+i+1, which is compared with
        # the next input of each candidate branch; follow the branches whose token equals the target's.
        cand = f.alive()
        new: list[int] = []
        i = 0
        while True:
            t = s.sample_at(logits[cand[0].rows[i]], f.pos0 + i + 1)
            new.append(t)
            nxt = [b for b in cand if len(b.tokens) > i + 1 and b.tokens[i + 1] == t]
            if not nxt:
                break
            cand, i = nxt, i + 1
        ended = [b for b in cand if len(b.tokens) == i + 1]  # branches matched to their very end
        matched_all = bool(ended)
        win = (ended or cand)[0]
        win_idx = f.branches.index(win)
        taken = s.commit(new)
        # Commit the KV of the inputs that are now committed tokens (through the winning branch's
        # sequence; none past an end of text), then drop every branch's sequence.
        self.pipe.seq_cp(win.seq, [CANONICAL_SEQ], f.pos0, f.pos0 + taken)
        self.drop(f)
        self.pipe.trace.instant("commit", now(), run=f.run_id, n=taken, branch=win_idx)
        # Acceptance counts only comparisons whose row was committed (not those past an end of text).
        compared = len(new) - 1 if matched_all else len(new)
        counted = min(compared, taken)
        acc.drafted += counted
        acc.accepted += counted - (0 if matched_all or counted < compared else 1)
        if f.speculative and f.parent is None:
            # A speculative run launched with nothing in flight starts with the last committed token
            # (a draft rank's reply): its drafted tokens were all checked here.
            acc.verified_runs += 1
        rest = self.valid()
        if s.done:
            return
        if not matched_all:
            self.rejections += 1
            self.cancel_from(0)
        elif rest:
            # The next run's first input is a draft token at the new frontier - 1: check it now.
            nxt_run = rest[0]
            acc.drafted += 1
            # A speculative run's verification starts here, with its first (drafted) token; count it
            # even if that token is rejected, so mean_accepted_len is per verified run as defined.
            acc.verified_runs += nxt_run.speculative
            ok = [k for k, b in enumerate(nxt_run.branches)
                  if b.alive and b.tokens[0] == s.tokens[-1] and nxt_run.pos0 == len(s.tokens) - 1]
            if nxt_run.parent == (f.run_id, win_idx) and ok:
                acc.accepted += 1
                self.prune(nxt_run, ok)
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
        if self.remote:
            self.run_async()
        else:
            self.run_sync()
        self.drain()

    def handle_arrived(self) -> bool:
        """Verify the oldest result if one has arrived, without waiting. True if one was handled."""
        self.pipe.poll()
        if not self.pipe.ready:
            return False
        self.handle(self.pipe.ready.popleft())
        return True

    def run_sync(self) -> None:
        pipe = self.pipe
        while not self.s.done:
            if self.handle_arrived():
                continue
            self.ensure_frontier_run()
            if self.speculate():
                continue  # check for results between drafts
            self.handle(pipe.next_result())

    def run_async(self) -> None:
        """The draft rank drafts while the head computes, verifies and launches."""
        pipe = self.pipe
        while not self.s.done:
            if self.handle_arrived():
                continue
            self.poll_draft()
            if self.launch_reply():
                continue
            self.request_draft()
            self.ensure_frontier_run()
            if pipe.ready:
                continue  # one stage: the run was computed on the spot
            self.wait_any()

    def drain(self) -> None:
        """Cancel what is left in flight and consume its results (and any draft reply), so the streams are clean."""
        self.s.metrics.runs.cancelled_at_end += self.inflight()
        self.cancel_from(0)
        while self.flights:
            self.flights.popleft()
            self.pipe.next_result()
        if self.remote:
            self.drafter.wait()
            self.reply = None


def _confident(probs: list[float], threshold: float) -> int:
    """Length of the leading run of probabilities >= threshold."""
    keep = 0
    while keep < len(probs) and probs[keep] >= threshold:
        keep += 1
    return keep


def decode_pipeinfer(pipe: Pipeline, s: Session, opts: DecodeOptions, drafter) -> None:
    PipeInfer(pipe, s, opts, drafter).run()
