"""Recording a trace: the target's tokens for each prompt (one stage, iterative: the tokens every
mode gives), then the draft's greedy chain from every committed prefix.

Two ways to the target's tokens: `target_tokens` runs the whole target in this process, through the
real request runner (`decode/request.py`, iterative) over the native engine (`plan --record`), and
`request_trace` takes them from a request a job has just run, in any mode and on any split
(`generate --save-trace`, `bench --save-trace`, `plan --record --record-ranks N`): decoding is
lossless, so both are the tokens `pipeinfer generate` prints. Then `draft_chains` asks the job's
own drafter (a draft model on the head, or a draft rank's proxy). Chains reuse each other: when the
draft's first token from a prefix was right, the chain from the next prefix is the same chain one
token on, plus one eval; only a wrong first token costs a whole new chain.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ..decode.drafters import Drafter
from ..decode.pipeline_protocol import RunResult
from ..decode.sampling import SamplingParams, sample_rows
from ..decode.modes import ITERATIVE
from ..decode.request import run_request
from ..decode.session import DecodeOptions
from ..decode.trace import TraceRecorder
from .replay import PromptTrace

PROB_DIGITS = 4
CHAIN_DEPTH = 24  # draft tokens recorded from each committed prefix: past n_draft x runs in flight


class EnginePipeline:
    """The whole target on this process (one stage): what the head's pipeline does with one rank."""

    n_stages = 1

    def __init__(self, engine):
        self.engine = engine
        self.trace = TraceRecorder(0)
        self.ready: deque[RunResult] = deque()
        self.sampling = SamplingParams()
        self.next_run_id = 1

    def set_sampling(self, params: SamplingParams) -> None:
        self.sampling = params

    def launch(self, tokens, pos, seq_ids, output, speculative=False, invariant=True) -> int:
        import numpy as np

        run_id, self.next_run_id = self.next_run_id, self.next_run_id + 1
        out_mask = np.asarray(output, bool)
        logits = self.engine.eval(tokens=np.asarray(tokens, np.int32), pos=np.asarray(pos, np.int32), seq_ids=seq_ids,
                                  output=out_mask, batch_invariant=invariant)
        self.ready.append(RunResult(run_id, sample_rows(logits, self.sampling, np.asarray(pos)[out_mask] + 1)))
        return run_id

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        self.engine.seq_rm(seq, p0, p1)

    def seq_cp(self, src: int, dsts: list[int], p0: int = -1, p1: int = -1) -> None:
        self.engine.seq_cp_many(src, dsts, p0, p1)

    def cancel(self, run_ids: list[int]) -> None:
        pass

    def poll(self) -> bool:
        return bool(self.ready)

    def next_result(self) -> RunResult:
        return self.ready.popleft()

    def wait_until(self, cond) -> None:
        if not cond():
            raise RuntimeError("one stage: nothing to wait for")


def target_tokens(engine, prompt: list[int], n_predict: int, is_eog: Callable[[int], bool],
                  sampling: SamplingParams) -> tuple[list[int], str]:
    """The target's tokens after `prompt` (and why it stopped), as iterative decoding gives them."""
    engine.kv_clear()
    pipe = EnginePipeline(engine)
    s = run_request(pipe, ITERATIVE.name, list(prompt), DecodeOptions(), None, sampling=sampling,
                    n_predict=n_predict, is_eog=is_eog)
    engine.kv_clear()
    return s.generated, s.finish_reason or "length"


def draft_chains(drafter: Drafter, pt: PromptTrace, depth: int, on_step: Callable[[int, int], None] | None = None) -> None:
    """Fill pt.chains: the draft's greedy chain (depth tokens) from every committed prefix after the
    first generated token."""
    full = pt.full
    pt.chains_from = len(pt.prompt) + 1
    pt.chains, pt.chain_probs = [], []
    drafter.start(pt.prompt)
    prev: tuple[list[int], list[float]] | None = None
    for n in range(pt.chains_from, len(full)):
        if prev is not None and prev[0] and prev[0][0] == full[n - 1]:
            more = drafter.propose(full[:n] + prev[0][1:], 1, 0.0)
            toks, probs = prev[0][1:] + more.tokens, prev[1][1:] + more.probs
        else:
            prop = drafter.propose(full[:n], depth, 0.0)
            toks, probs = prop.tokens, prop.probs
        pt.chains.append(list(toks))
        pt.chain_probs.append([round(p, PROB_DIGITS) for p in probs])
        prev = (toks, probs)
        if on_step is not None:
            on_step(n - pt.chains_from + 1, len(full) - pt.chains_from)


def request_trace(prompt_id: str, prompt: list[int], generated: list[int], finish_reason: str | None, drafter: Drafter | None = None,
                  depth: int = CHAIN_DEPTH) -> PromptTrace:
    """The trace of a request a job ran: its prompt and committed tokens and, given the job's drafter
    (a draft model of the target's vocabulary), its chains `depth` deep. finish_reason: the
    session's ("stop": an end of generation or a stop string, replayed as an end at the last token)."""
    pt = PromptTrace(prompt_id, list(prompt), list(generated), "stop" if finish_reason == "stop" else "length")
    if drafter is not None and generated:
        draft_chains(drafter, pt, depth)
    return pt


def draft_agreement(drafter: Drafter, full: list[int], start: int) -> tuple[list[float], list[float]]:
    """How the draft does against the target's tokens `full` from position `start` on: at every
    position, its greedy next token after the committed prefix; (probabilities of the tokens it got
    right, of those it got wrong). The acceptance `calibrate --draft` records."""
    right, wrong = [], []
    drafter.start(full[:start])
    for n in range(start, len(full)):
        prop = drafter.propose(full[:n], 1, 0.0)
        if prop.tokens:
            (right if prop.tokens[0] == full[n] else wrong).append(round(prop.probs[0], PROB_DIGITS))
    return right, wrong
