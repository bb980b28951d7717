"""One request, start to end: prefill, the mode's decode loop, the finished session, for the head
and the planner alike.

The head (`runtime/head.py`, over MPI on the wall clock) and the planner (`planner/predict.py`, on
a simulated pipeline in virtual time) both run their requests here, so a prediction walks exactly
the steps of a real run; only what differs is passed in (the clock, where the draft computes, the
trace, the streaming callbacks). `prefill` and the mode dispatch are called nowhere else
(tests/test_request_runner.py checks).

Importing this starts no MPI: the pipeline is a `PipelineLike` (pipeline_protocol.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .draft_economy import DraftMemory
from .drafters import AsyncDrafter, Drafter, Proposal
from .metrics import now
from .modes import PIPEINFER, SPECULATIVE, decode, needs_draft
from .pipeline_protocol import PipelineLike
from .sampling import SamplingParams
from .session import DecodeOptions, Session
from .sync import prefill
from .text_stream import TextStream
from .trace import TraceRecorder


@dataclass(frozen=True)
class DraftSite:
    """Where the request's draft computes, which decides how its prompt pass runs and who traces it.

    on_head: on the head's own cores (a draft model or prompt lookup in the head's process, not a
    draft rank): with one stage in pipeinfer mode (spec_policy auto) the prompt pass waits until
    drafting has shown it may pay, since it would take the target's cores (draft_economy.py).
    threaded: the prompt pass runs in a thread beside the target's prefill (wall time); a
    simulated pipeline charges it to its virtual clock instead.
    trace: where an on-head draft's prompt pass and (speculative mode) proposals become 'draft'
    slices; None: not traced (a draft rank traces its own work; pipeinfer traces its own calls).
    """

    on_head: bool = True
    threaded: bool = True
    trace: TraceRecorder | None = None


@dataclass(frozen=True)
class Streaming:
    """What the caller sees while the request decodes (all optional).

    on_token: each committed token; text: the stream that completes UTF-8 and cuts stop strings,
    on_text: the text it shows; cancelled: polled at each commit, True ends the request."""

    on_token: Callable[[int], None] | None = None
    text: TextStream | None = None
    on_text: Callable[[str], None] | None = None
    cancelled: Callable[[], bool] | None = None


def run_request(pipe: PipelineLike, mode: str, prompt: list[int], opts: DecodeOptions,
                drafter: Drafter | AsyncDrafter | None, *,
                sampling: SamplingParams, n_predict: int, is_eog: Callable[[int], bool],
                streaming: Streaming = Streaming(), site: DraftSite = DraftSite(), reuse: int = 0,
                draft_reuse: int | None = None, memory: DraftMemory | None = None,
                clock: Callable[[], float] = now, resume: list[int] | None = None) -> Session:
    """Generate one request's tokens in `mode`; returns the finished session.

    drafter: the request's drafter (None without one). reuse: leading prompt tokens whose cells the
    canonical sequence already holds (prefix reuse). draft_reuse: leading prompt tokens the draft's
    cache may keep, when not `reuse` (a parallel slot's draft model last served another slot).
    memory: what the job's earlier requests learned about drafting on one stage. clock: the
    session's clock (a simulated pipeline passes its virtual time). resume: the tokens this request
    committed on a job that was lost: replayed after the prompt (sync.prefill), not shown again."""
    s = Session(prompt, sampling, n_predict, is_eog, streaming.on_token, text=streaming.text,
                on_text=streaming.on_text, clock=clock, cancelled=streaming.cancelled)
    traced = site.trace if site.on_head else None
    draft_prefill = None
    if drafter is not None and needs_draft(mode):
        known = prompt + list(resume or ())  # the draft reads what the target has committed
        draft_prefill = _prompt_pass(drafter, known, reuse if draft_reuse is None else draft_reuse,
                                     len(known) - reuse, traced)
    deferred = (draft_prefill is not None and mode == PIPEINFER.name and site.on_head and pipe.n_stages == 1
                and opts.spec_policy == "auto" and drafter.has_prompt_pass)
    prefill(pipe, s, None if deferred else draft_prefill, draft_in_thread=site.threaded, start=reuse,
            replay=resume or (), ubatch=opts.ubatch,
            draft_elsewhere=isinstance(drafter, AsyncDrafter) and not drafter.has_prompt_pass)
    if mode == SPECULATIVE.name and traced is not None:
        drafter = _TracedDrafter(drafter, traced)
    decode(mode, pipe, s, opts, drafter, prompt_pass=draft_prefill if deferred else None, memory=memory)
    s.finish_text()
    return s


def _prompt_pass(drafter: Drafter | AsyncDrafter, prompt: list[int], keep: int, n_new: int,
                 trace: TraceRecorder | None) -> Callable[[], None]:
    """The draft's pass over the prompt (keeping the first `keep` tokens of its cache), traced as a
    'draft' slice of n_new tokens when `trace` is given."""
    def run() -> None:
        t0 = now()
        drafter.start(prompt, keep)
        if trace is not None:
            trace.slice("draft", t0, now(), n_tokens=n_new, prefill=True)

    return run


class _TracedDrafter:
    """An on-head drafter whose propose() calls become 'draft' slices on the head's track."""

    def __init__(self, drafter: Drafter, trace: TraceRecorder):
        self._drafter, self._trace = drafter, trace

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        t0 = now()
        prop = self._drafter.propose(path, n_max, p_min)
        self._trace.slice("draft", t0, now(), n_tokens=len(prop.tokens))
        return prop

    def __getattr__(self, name: str):
        return getattr(self._drafter, name)
