"""Drafters in virtual time, with the real drafters' interfaces (`decode/drafters.py`):

- `ReplayDrafter`: a draft model on the head. It answers from the trace's chains and charges the
  head the evals `LlamaDrafter` would make (it keeps the same KV bookkeeping: the longest prefix
  shared with the last path is reused). Its prompt pass runs beside the head (a thread in the real
  job), so only the first proposal waits for it.
- `ReplayDraftRank`: a draft model on a rank of its own, asynchronous (`AsyncDrafter`): a request
  reaches it over a link, it drafts when free, the reply comes back over the link.
- `TimedLookup`: prompt lookup, the real `LookupDrafter`, at the measured cost per proposed token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..decode.drafters import Proposal, continues
from ..decode.lookup import LookupDrafter
from ..transport.messages import STREAM_AHEAD
from .profile import DraftCosts, LinkCosts
from .replay import ChainIndex, greedy_walk
from .sim_pipeline import SimulatedPipeline


class _DraftModel:
    """The draft's KV bookkeeping and eval count, as `LlamaDrafter` does it."""

    def __init__(self, index: ChainIndex, costs: DraftCosts):
        self.index, self.costs = index, costs
        self.kv_tokens: list[int] = []
        self.evals = 0
        self.loop_evals = 0

    def read(self, tokens: list[int], reuse: int = 0) -> float:
        """Seconds of a prompt pass (batched) over the tokens past the first `reuse`."""
        self.kv_tokens = list(tokens)
        return (len(tokens) - reuse) * self.costs.prompt_token_s

    def propose(self, path: list[int], n_max: int, p_min: float) -> tuple[Proposal, float]:
        """The proposal and its seconds."""
        if n_max <= 0:
            return Proposal([], [], []), 0.0
        common, limit = 0, min(len(self.kv_tokens), len(path) - 1)
        while common < limit and self.kv_tokens[common] == path[common]:
            common += 1
        prop, loop_evals = greedy_walk(self.index, path, n_max, p_min)
        self.loop_evals = loop_evals  # evals after the first token's (a stream's tokens come one per eval)
        evals = len(path) - common + loop_evals
        self.kv_tokens = list(path) + prop.tokens[:loop_evals]
        self.evals += evals
        return prop, evals * self.costs.token_s


class ReplayDrafter:
    name = "model"
    has_prompt_pass = True

    def __init__(self, pipe: SimulatedPipeline, index: ChainIndex, costs: DraftCosts):
        self.pipe, self.model = pipe, _DraftModel(index, costs)
        self.free_at = 0.0  # the prompt pass, beside the head

    def start(self, prompt: list[int], reuse: int = 0) -> None:
        self.free_at = self.pipe.t + self.model.read(prompt, reuse)

    def read_context(self, tokens: list[int]) -> None:
        self.pipe.t = max(self.pipe.t, self.free_at)
        self.pipe.head_compute(self.model.read(tokens), self.model.costs.threads)

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        prop, seconds = self.model.propose(path, n_max, p_min)
        self.pipe.t = max(self.pipe.t, self.free_at)
        self.pipe.head_compute(seconds, self.model.costs.threads)
        return prop

    def close(self) -> None:
        pass


@dataclass
class _SimStream:
    """A draft rank's stream in virtual time (runtime/remote_draft.py streams token by token): the
    tokens it drafts from `base`, and when each is drafted at the rank."""

    base: list[int]
    prop: Proposal
    p_min: float
    ready: Callable[[int], float]  # token i of the stream is drafted then (as now foreseen)

    def offers(self, path: list[int]) -> bool:
        return continues(self.base, self.prop.tokens, path)


class ReplayDraftRank:
    """The head's view of a draft rank (`RemoteDrafter`), in virtual time.

    As the real one, the rank streams: it drafts STREAM_AHEAD tokens beyond what a request asked for
    (without a confidence cutoff), a request that continues the stream is answered from it without
    a message, and the reply comes once the first token past the path is drafted (with whatever else
    is by then). A request for another path makes the rank leave the old stream after the token in
    progress (SimulatedPipeline.draft_leave)."""

    name = "model"
    has_prompt_pass = False  # as RemoteDrafter: the draft rank reads the prompt on its own cores

    def __init__(self, pipe: SimulatedPipeline, index: ChainIndex, costs: DraftCosts, to_rank: LinkCosts,
                 to_head: LinkCosts):
        self.pipe, self.model = pipe, _DraftModel(index, costs)
        self.to_rank, self.to_head = to_rank, to_head
        self.requested: list[int] | None = None
        self.reply: Proposal | None = None
        self.stream: _SimStream | None = None
        self.job: int | None = None  # the draft rank's job drafting the stream
        self.done: Callable[[], float] = lambda: 0.0  # when the draft rank has the reply (as now foreseen)
        self.whole: Proposal | None = None  # every token the request asked for, and when it has them
        self.whole_at: Callable[[], float] = lambda: 0.0
        self.reply_bytes = 0
        pipe.event_sources.append(lambda: self.reply_at if self.requested is not None else None)

    @property
    def reply_at(self) -> float:
        return self.done() + self.to_head.seconds(self.reply_bytes)

    @property
    def outstanding(self) -> bool:
        return self.requested is not None

    def start(self, prompt: list[int], reuse: int = 0) -> None:
        self.stream = None
        arrive = self.pipe.t + self.to_rank.seconds(8 * len(prompt))
        self.pipe.draft_job(arrive, self.model.read(prompt, reuse))
        self.job = None

    def _open(self, path: list[int], n_max: int, p_min: float) -> _SimStream:
        arrive = self.pipe.t + self.to_rank.seconds(8 * len(path))
        token_s = self.model.costs.token_s
        if self.job is not None:
            self.pipe.draft_leave(self.job, arrive, token_s)  # the rank leaves the old stream
        prop, seconds = self.model.propose(path, n_max, p_min)
        # Token i is drafted after the evals that read the path and i more; the job ends with the
        # last eval (loop_evals after the first token's).
        loop = self.model.loop_evals
        self.job, end = self.pipe.draft_job(arrive, seconds)  # behind whatever the rank is doing
        self.stream = _SimStream(list(path), prop, p_min, lambda i, e=end: e() - (loop - i) * token_s)
        return self.stream

    def request(self, path: list[int], n_max: int, p_min: float, ahead: int = STREAM_AHEAD) -> None:
        assert self.requested is None, "one draft request at a time"
        st = self.stream
        if st is None or st.p_min != p_min or not st.offers(path):
            st = self._open(path, n_max + ahead, p_min)
        i = len(path) - len(st.base)
        toks, probs = st.prop.tokens[i:i + n_max], st.prop.probs[i:i + n_max]
        self.whole = Proposal(toks, probs, [[] for _ in toks])
        self.whole_at = lambda s=st, j=i + len(toks) - 1: s.ready(max(j, 0)) + self.to_head.seconds(12 * len(toks))
        if toks and ahead > 0:
            # Asynchronous use: the reply leaves with the first token; any drafted by then go along.
            first = st.ready(i)
            k = 1 + sum(1 for j in range(i + 1, i + len(toks)) if st.ready(j) <= max(first, self.pipe.t))
            toks, probs = toks[:k], probs[:k]
        last = i + len(toks) - 1
        self.done = lambda s=st, j=max(last, 0): s.ready(j)
        self.reply_bytes = 12 * len(toks)
        self.requested, self.reply = list(path), Proposal(toks, probs, [[] for _ in toks])

    def ready(self) -> bool:
        return self.requested is not None and self.pipe.t >= self.reply_at

    def poll(self, whole: bool = False) -> Proposal | None:
        """The reply once it has arrived; whole: all the tokens asked for (or the stream's end)."""
        if self.requested is None or self.pipe.t < (self.whole_at() if whole else self.reply_at):
            return None
        prop = self.whole if whole else self.reply
        prop.base, self.requested, self.reply = self.requested, None, None
        return prop

    def wait(self, whole: bool = False) -> Proposal | None:
        if self.requested is None:
            return None
        self.pipe.t = max(self.pipe.t, self.whole_at() if whole else self.reply_at)
        return self.poll(whole)

    def end_stream(self) -> None:
        """The end of a request: the rank stops drafting ahead."""
        if self.job is not None:
            self.pipe.draft_leave(self.job, self.pipe.t + self.to_rank.seconds(8), self.model.costs.token_s)
        self.requested, self.stream, self.job = None, None, None

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        """Synchronous (speculative mode): n_max tokens, drafted after the request and no further."""
        self.request(path, n_max, p_min, ahead=0)
        return self.wait(whole=True)

    def close(self) -> None:
        pass


class TimedLookup(LookupDrafter):
    """Prompt lookup as the head runs it, charging the measured seconds per proposed token."""

    def __init__(self, pipe: SimulatedPipeline, costs: DraftCosts):
        super().__init__()
        self.pipe, self.costs = pipe, costs

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        prop = super().propose(path, n_max, p_min)
        self.pipe.t += self.costs.token_s * max(len(prop.tokens), 1)
        return prop
