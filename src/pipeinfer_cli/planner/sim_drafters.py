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

from ..decode.drafters import Proposal
from ..decode.lookup import LookupDrafter
from .profile import DraftCosts, LinkCosts
from .replay import ChainIndex, greedy_walk
from .sim_pipeline import SimulatedPipeline


class _DraftModel:
    """The draft's KV bookkeeping and eval count, as `LlamaDrafter` does it."""

    def __init__(self, index: ChainIndex, costs: DraftCosts):
        self.index, self.costs = index, costs
        self.kv_tokens: list[int] = []
        self.evals = 0

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


class ReplayDraftRank:
    """The head's view of a draft rank (`RemoteDrafter`), in virtual time."""

    name = "model"
    has_prompt_pass = False  # as RemoteDrafter: the draft rank reads the prompt on its own cores

    def __init__(self, pipe: SimulatedPipeline, index: ChainIndex, costs: DraftCosts, to_rank: LinkCosts,
                 to_head: LinkCosts):
        self.pipe, self.model = pipe, _DraftModel(index, costs)
        self.to_rank, self.to_head = to_rank, to_head
        self.requested: list[int] | None = None
        self.reply: Proposal | None = None
        self.done: Callable[[], float] = lambda: 0.0  # when the draft rank has the reply (as now foreseen)
        self.reply_bytes = 0
        pipe.event_sources.append(lambda: self.reply_at if self.requested is not None else None)

    @property
    def reply_at(self) -> float:
        return self.done() + self.to_head.seconds(self.reply_bytes)

    @property
    def outstanding(self) -> bool:
        return self.requested is not None

    def start(self, prompt: list[int], reuse: int = 0) -> None:
        arrive = self.pipe.t + self.to_rank.seconds(8 * len(prompt))
        self.pipe.draft_job(arrive, self.model.read(prompt, reuse))

    def request(self, path: list[int], n_max: int, p_min: float) -> None:
        assert self.requested is None, "one draft request at a time"
        arrive = self.pipe.t + self.to_rank.seconds(8 * len(path))
        prop, seconds = self.model.propose(path, n_max, p_min)
        self.done = self.pipe.draft_job(arrive, seconds)  # behind whatever the rank is doing
        self.reply_bytes = 12 * len(prop.tokens)
        self.requested, self.reply = list(path), prop

    def ready(self) -> bool:
        return self.requested is not None and self.pipe.t >= self.reply_at

    def poll(self, whole: bool = False) -> Proposal | None:
        if not self.ready():
            return None
        prop = self.reply
        prop.base, self.requested, self.reply = self.requested, None, None
        return prop

    def wait(self, whole: bool = False) -> Proposal | None:
        if self.requested is None:
            return None
        self.pipe.t = max(self.pipe.t, self.reply_at)
        return self.poll()

    def propose(self, path: list[int], n_max: int, p_min: float) -> Proposal:
        self.request(path, n_max, p_min)
        return self.wait()

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
