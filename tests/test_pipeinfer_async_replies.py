"""pipeinfer mode's asynchronous drafting, in process and without MPI: a head-only pipeline on a
tiny qwen2 file and a scripted draft rank whose replies arrive late, stale or wrong."""

from __future__ import annotations

import pytest


GREEDY = ()
TEMP = ("--temp", "0.8", "--seed", "7")


class ScriptedDraftRank:
    """An asynchronous drafter (the head-side interface of a draft rank) whose replies take `delay`
    polls to arrive and continue the request's path with the true text, every third one wrong at its end."""

    def __init__(self, truth: list[int], delay: int):
        self.truth, self.delay = truth, delay
        self.requested = None
        self.countdown = 0
        self.replies = 0

    @property
    def outstanding(self) -> bool:
        return self.requested is not None

    def request(self, path, n_max, p_min):
        assert self.requested is None, "one draft request at a time"
        self.requested, self.countdown = (list(path), n_max), self.delay

    def ready(self) -> bool:
        self.countdown -= 1
        return self.countdown <= 0

    def poll(self, whole=False):
        from pipeinfer_cli.decode.drafters import Proposal

        if self.requested is None or not self.ready():
            return None
        (path, n), self.requested = self.requested, None
        self.replies += 1
        toks = list(self.truth[len(path):len(path) + n]) if path == self.truth[:len(path)] else [3] * n
        if self.replies % 3 == 0 and toks:
            toks[-1] = (toks[-1] + 1) % 300
        return Proposal(toks, [0.9] * len(toks), [[] for _ in toks], base=path)

    def wait(self, whole=False):
        self.countdown = 0
        return self.poll()

    def end_stream(self):
        self.requested = None


@pytest.mark.parametrize("delay", [1, 3, 8])
@pytest.mark.parametrize("sampling", [GREEDY, TEMP])
def test_async_replies_are_launched_only_when_consistent(tiny_pair, delay, sampling):
    """Head-only pipeline and a scripted draft rank: stale, wrong and late replies never change the tokens,
    and consistent ones are launched (also as a run that starts with the last committed token)."""
    from pipeinfer_cli.decode.pipeinfer import decode_pipeinfer
    from pipeinfer_cli.decode.sync import decode_iterative, prefill
    from pipeinfer_cli.runtime.pipeline import Pipeline
    from pipeinfer_cli.decode.sampling import SamplingParams
    from pipeinfer_cli.decode.session import DecodeOptions, Session
    from pipeinfer_cli.decode.trace import TraceRecorder
    from pipeinfer_cli.native import LayerEngine

    target, _ = tiny_pair
    params = SamplingParams(temperature=0.8, seed=7) if sampling else SamplingParams()
    engine = LayerEngine(str(target), 0, 6, n_ctx=256, n_seq_max=18)
    pipe = Pipeline(None, engine, 1, TraceRecorder(0))
    prompt = list(range(5, 25))
    s = Session(prompt, params, 48, lambda t: False)
    prefill(pipe, s)
    decode_iterative(pipe, s)
    truth = list(s.tokens)
    pipe.kv_clear()
    drafter = ScriptedDraftRank(truth, delay)
    s = Session(prompt, params, 48, lambda t: False)
    prefill(pipe, s)
    decode_pipeinfer(pipe, s, DecodeOptions(n_predict=48, p_accept=0.5, n_draft=4), drafter)
    assert s.tokens == truth
    m = s.metrics
    assert m.runs.speculative > 0 and drafter.replies > 0
    assert m.acceptance.accepted > 0
    assert not drafter.outstanding  # the last request was drained
    assert engine.kv_used_cells() == len(truth) - 1
