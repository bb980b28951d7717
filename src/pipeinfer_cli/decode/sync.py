"""The two synchronous baselines: `iterative` (one token per pass) and `speculative`
(draft k tokens, verify them in one batch, keep the longest matching prefix plus one token)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

from .drafters import Drafter
from .pipeline_protocol import PipelineLike, may_speculate
from .session import CANONICAL_SEQ, DecodeOptions, Session, prefill_chunks


def prefill(pipe: PipelineLike, s: Session, draft_prefill: Callable[[], None] | None = None,
            draft_in_thread: bool = True, start: int = 0, replay: Sequence[int] = (),
            ubatch: int | None = None, draft_elsewhere: bool = False) -> None:
    """Process the prompt into the canonical sequence and commit the first token.

    replay: tokens this request committed before, on a job that was lost (a server's request
    resumed: docs/server.md, "Surviving a lost node"). They follow the prompt into the cache in
    batch-invariant runs, which compute each row exactly as one-token decoding computed it, so the
    cache and the next token are bit for bit the ones the lost job had; they are committed without
    being shown again (Session.replay), and the token after them is the first one shown.

    start: prompt tokens whose cells the canonical sequence already holds (prefix reuse; a chunk
    boundary, so the chunks are the very ones a prefill from 0 computes: session.prefill_chunks).
    ubatch: the chunks' size (--ubatch); None: the small-first chunks.
    The chunks are launched back to back, so on several ranks the stages work on chunk i while the
    head computes chunk i+1; only the last chunk asks for logits (its last row).

    `draft_prefill` (the draft model's own pass over the prompt) must not delay the first token:
    with several stages it runs while they compute, in a thread when it computes on the head
    (draft_in_thread; llama.cpp releases the GIL), so that the first token is committed the moment
    the target's logits arrive, even if the draft is still busy; with a single stage there is
    nothing to overlap, and it runs after the first token. A draft that reads the prompt on other
    cores (draft_elsewhere: a draft rank) is sent the prompt before the chunks are launched, since
    the head computes its own layers of each chunk inside the launch: it drafts from the first token on.
    """
    prompt = s.tokens
    pipe.set_sampling(s.sampling)  # every request starts here: the last stage samples its rows
    n_chunks = 0
    if draft_prefill is not None and draft_elsewhere:
        draft_prefill()
        draft_prefill = None
    for b, e in prefill_chunks(start, len(prompt), ubatch):
        chunk = prompt[b:e]
        last = e == len(prompt)
        pipe.launch(chunk, list(range(b, b + len(chunk))), [[CANONICAL_SEQ]] * len(chunk),
                    [False] * (len(chunk) - 1) + [last], invariant=False)
        n_chunks += 1
    replayed = _launch_replay(pipe, replay, len(prompt))
    n_chunks += replayed
    overlapped = draft_prefill is not None and pipe.n_stages > 1
    worker = None
    if overlapped and draft_in_thread:
        worker = _Background(draft_prefill)
    elif overlapped:
        draft_prefill()
    try:
        for _ in range(n_chunks):
            res = pipe.next_result()
        s.metrics.runs.launched += n_chunks
        if replay:
            s.replay(replay)
        s.commit([int(res.tokens[0])])
    except BaseException:
        if worker is not None:
            threading.Thread.join(worker)  # the first error wins; the draft's own is dropped
        raise
    if worker is not None:
        worker.join()  # re-raises what the draft's prefill raised
    if draft_prefill is not None and not overlapped and not s.done:
        draft_prefill()


REPLAY_RUN = 32  # tokens per batch-invariant run when a resumed request replays what it had committed


def _launch_replay(pipe: PipelineLike, replay: Sequence[int], start: int) -> int:
    """Launch the replayed tokens at positions start.. in runs of REPLAY_RUN; only the very last row
    asks for logits (the token after them). Returns the runs launched."""
    tokens = list(replay)
    for b in range(0, len(tokens), REPLAY_RUN):
        chunk = tokens[b:b + REPLAY_RUN]
        last = b + len(chunk) == len(tokens)
        pipe.launch(chunk, list(range(start + b, start + b + len(chunk))), [[CANONICAL_SEQ]] * len(chunk),
                    [False] * (len(chunk) - 1) + [last], invariant=True)
    return -(-len(tokens) // REPLAY_RUN)


DRAFT_PREFILL_NICE = 10  # added to the draft prefill thread's nice value


class _Background(threading.Thread):
    """Runs fn in a thread at a lower CPU priority; join() re-raises its exception.

    The draft's prompt pass must not delay the first token: where the head's host has no idle core
    (3 stages on 2 cores), it would take CPU time from the stages' prefill (BENCHMARKS.md, "The same
    suite on the grounded prompts"). At a higher nice value it uses what the stages leave idle.
    Linux gives each thread its own nice value, and threads it starts (OpenMP's) inherit it."""

    def __init__(self, fn: Callable[[], None]):
        super().__init__(daemon=True, name="draft-prefill")
        self.fn, self.error = fn, None
        self.start()

    def run(self) -> None:
        try:
            lower_thread_priority(DRAFT_PREFILL_NICE)
            self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller in join()
            self.error = exc

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


def lower_thread_priority(by: int) -> None:
    """Raise the calling thread's nice value by `by` (Linux: per thread); a no-op where not possible."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except (AttributeError, OSError):
        pass


def decode_iterative(pipe: PipelineLike, s: Session) -> None:
    while not s.done:
        pos = len(s.tokens) - 1  # the last committed token is not in the KV yet
        pipe.launch([s.tokens[-1]], [pos], [[CANONICAL_SEQ]], [True])
        s.metrics.runs.launched += 1
        res = pipe.next_result()
        s.commit([int(res.tokens[0])])


def verify(sampled, draft: list[int]) -> list[int]:
    """The committed tokens of a verified batch [last, d0, d1, …]: the accepted drafts (those equal to
    the target's own sample) plus the target's token after them. sampled[i] is the target's token
    after row i (sampled by the last stage)."""
    out: list[int] = []
    for i in range(len(draft) + 1):
        t = int(sampled[i])
        out.append(t)
        if i == len(draft) or t != draft[i]:
            break
    return out


def decode_speculative(pipe: PipelineLike, s: Session, opts: DecodeOptions, drafter: Drafter) -> None:
    while not s.done:
        pos = len(s.tokens) - 1
        # Never draft past -n: tokens beyond it would be verified for nothing.
        n_max = min(opts.n_draft, s.remaining - 1)
        prop = drafter.propose(s.tokens, n_max, opts.p_min) if n_max > 0 and may_speculate(pipe) else None
        draft = prop.tokens if prop is not None else []
        s.metrics.drafting.proposed += len(draft)
        s.metrics.drafting.launched += len(draft)
        batch = [s.tokens[-1]] + draft
        pipe.launch(batch, list(range(pos, pos + len(batch))), [[CANONICAL_SEQ]] * len(batch), [True] * len(batch),
                    speculative=bool(draft))
        s.metrics.runs.launched += 1
        s.metrics.runs.speculative += bool(draft)
        res = pipe.next_result()
        new = verify(res.tokens, draft)
        n_acc = len(new) - 1
        if n_acc < len(draft):
            # Roll back the rejected drafts' KV on every stage (the batch wrote positions pos…).
            pipe.seq_rm(CANONICAL_SEQ, pos + 1 + n_acc, -1)
        taken = s.commit(new)
        if draft:
            # Count the drafts compared with a committed target token (none past an end of text).
            compared = min(len(draft), n_acc + 1, taken)
            s.metrics.acceptance.add(compared, min(n_acc, compared), prop.source)
            s.metrics.acceptance.verified_runs += 1
