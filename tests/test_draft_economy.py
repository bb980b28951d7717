"""`pipeinfer` on one stage drafts only while drafting pays (decode/draft_economy.py).

Against the fake pipeline of test_pipeinfer_policy.py with a virtual clock that charges what a CPU
does: a one-token run costs 1, a batch of k rows 0.83·k, and the drafter `d` per token it proposes.
No model, no MPI: the account and the schedule it makes, and the tokens, which never change.
"""

from __future__ import annotations

import pytest

from pipeinfer_cli.decode.pipeinfer import PipeInfer
from pipeinfer_cli.decode.sync import prefill
from pipeinfer_cli.decode.draft_economy import FIRST_INTERVAL, MAX_INTERVAL, PROBE_CONTEXT, DraftEconomy, DraftMemory
from pipeinfer_cli.decode.session import DecodeOptions, Session
from test_pipeinfer_policy import GREEDY, PROMPT, FakePipeline, OracleDrafter, reference

ROW_IN_BATCH = 0.83  # a verification row against a one-token run, measured on the 2-core machine


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class CostedPipeline(FakePipeline):
    def __init__(self, clock: Clock):
        super().__init__(latency=0)
        self.clock = clock

    def launch(self, tokens, pos, seq_ids, output, speculative=False, invariant=True):
        self.clock.t += 1.0 if len(tokens) == 1 else ROW_IN_BATCH * len(tokens)
        return super().launch(tokens, pos, seq_ids, output, speculative, invariant)


class CostedDrafter(OracleDrafter):
    """Costs `cost_per_token` per token it drafts and, like a draft model whose KV cache follows
    the path, 0.83 of that per token of the path it has not seen yet (its catch-up batch)."""

    def __init__(self, clock: Clock, cost_per_token: float, **kw):
        super().__init__(**kw)
        self.clock, self.cost = clock, cost_per_token
        self.seen: list[int] = []

    def propose(self, path, n_max, p_min):
        common = next((i for i, (a, b) in enumerate(zip(self.seen, path)) if a != b), min(len(self.seen), len(path)))
        self.clock.t += ROW_IN_BATCH * self.cost * (len(path) - common)
        out = super().propose(path, n_max, p_min)
        self.clock.t += self.cost * len(out.tokens)
        self.seen = list(path) + out.tokens
        return out

    def read_context(self, tokens):
        self.clock.t += ROW_IN_BATCH * self.cost * len(tokens)
        self.seen = list(tokens)


class PromptPass:
    """The draft model's pass over the prompt, deferred: it costs 0.83·d per prompt token."""

    def __init__(self, clock: Clock, drafter: CostedDrafter, prompt: list[int]):
        self.clock, self.drafter, self.prompt, self.runs = clock, drafter, prompt, 0

    def __call__(self):
        self.runs += 1
        self.clock.t += ROW_IN_BATCH * self.drafter.cost * len(self.prompt)
        self.drafter.seen = list(self.prompt)


def run(d: float, policy: str, n: int = 120, prompt=PROMPT, deferred: bool = False,
        memory: DraftMemory | None = None, p_reach: float = DecodeOptions.p_reach, **drafter):
    clock = Clock()
    pipe = CostedPipeline(clock)
    s = Session(list(prompt), GREEDY, n, lambda t: False, clock=clock)
    prefill(pipe, s)
    t0 = clock.t
    draft = CostedDrafter(clock, d, **drafter)
    prompt_pass = PromptPass(clock, draft, list(prompt)) if deferred else None
    if not deferred:  # read after the first token, as on one stage
        PromptPass(clock, draft, list(prompt))()
    p = PipeInfer(pipe, s, DecodeOptions(n_predict=n, n_draft=4, spec_policy=policy, p_reach=p_reach), draft,
                  wait_until=lambda c: None, clock=clock, prompt_pass=prompt_pass, memory=memory)
    p.run()
    assert s.tokens == reference(n, prompt=list(prompt))  # the schedule changes, never the tokens
    p.prompt_pass_runs = prompt_pass.runs if deferred else None
    return (clock.t - t0) / n, s.metrics.runs.speculative, p


def test_a_costly_draft_is_switched_off_and_probed_less_and_less():
    # The 0.5B draft of the 1.5B target on one rank: 0.6 of a target token per drafted token.
    always, spec_always, _ = run(0.6, "always")
    auto, spec_auto, p = run(0.6, "auto")
    assert always > 1.2  # drafting loses: more than a one-token run per committed token
    assert auto < always * 0.85 and auto < 1.1
    assert 0 < spec_auto < spec_always / 4
    # Its drafting alone cost more than the run could have saved: ended at the first pause.
    assert p.gate.economy.off and p.s.metrics.runs.drafting_paused == 1 and spec_auto == 1


def test_a_free_and_right_draft_keeps_drafting():
    # Prompt lookup on text that copies the prompt: no cost, always right, confident.
    always, spec_always, _ = run(0.0, "always", p=0.99)
    auto, spec_auto, p = run(0.0, "auto", p=0.99)
    assert always < 1.0  # drafting pays here: 4 tokens for 1 + 4·0.83
    assert spec_auto == spec_always and auto == pytest.approx(always)
    assert p.gate.economy.pauses == 0


def test_a_draft_that_is_often_wrong_is_switched_off():
    # Free to draft but wrong at every third position: each run saves less than it costs. (Runs
    # of any length, p_reach 0: the economy alone.)
    always, _, _ = run(0.0, "always", wrong=lambda pos: pos % 3 == 0, p_reach=0.0)
    auto, _, p = run(0.0, "auto", wrong=lambda pos: pos % 3 == 0, p_reach=0.0)
    assert auto < always and p.gate.economy.pauses > 0


def test_runs_of_an_often_wrong_draft_shorten_to_what_its_acceptance_is_worth():
    # Wrong at every third position (acceptance about 2/3): with p_reach 0.5 runs stay short (a
    # token 2 ahead is reached 4 times in 9), not --n-draft 4 whose later tokens are mostly
    # verified for nothing.
    wrong = lambda pos: pos % 3 == 0  # noqa: E731
    long_runs, _, p0 = run(0.0, "always", wrong=wrong, p_reach=0.0)
    short_runs, _, p = run(0.0, "always", wrong=wrong)
    assert short_runs < long_runs
    d0, d = p0.s.metrics.drafting, p.s.metrics.drafting
    assert d.proposed < 0.7 * d0.proposed and d.launched < 0.7 * d0.launched


def test_drafting_comes_back_when_it_pays_again():
    # Wrong for the first 30 generated positions, then right: a probe finds the change.
    start = len(PROMPT) + 30
    _, spec, p = run(0.0, "auto", n=160, wrong=lambda pos: pos < start)
    assert p.gate.economy.pauses > 0 and p.gate.economy.wait == 0 and spec > 20


LONG_PROMPT = [(7 * i) % 50 + 1 for i in range(500)]


def test_a_costly_draft_never_reads_a_long_prompt():
    # The 0.5B draft on a 500-token prompt: its prompt pass alone would cost 0.83·0.6·500 = 249
    # one-token runs, more than the 120 tokens take. The probe (from the last PROBE_CONTEXT tokens)
    # finds the draft hopeless, and the prompt is never read.
    deferred, spec, p = run(0.6, "auto", prompt=LONG_PROMPT, deferred=True)
    assert p.prompt_pass_runs == 0 and spec == 1 and p.gate.economy.off
    assert p.drafter.calls[0][0] == p.s.tokens[:len(LONG_PROMPT) + 1][-PROBE_CONTEXT:]  # after the first token
    read_at_once, _, _ = run(0.6, "auto", prompt=LONG_PROMPT)
    assert deferred < 1.25 and read_at_once > deferred + 1.5


def test_a_cheap_draft_reads_the_prompt_after_its_probe_and_drafts_on():
    # A free, always-right draft: the probe pays, the prompt pass runs once, drafting goes on.
    _, spec_deferred, p = run(0.0, "auto", prompt=LONG_PROMPT, deferred=True, p=0.99)
    _, spec_at_once, _ = run(0.0, "auto", prompt=LONG_PROMPT, p=0.99)
    assert p.prompt_pass_runs == 1 and p.gate.economy.pauses == 0
    assert spec_deferred >= spec_at_once - 1
    # Every draft after the probe continues the whole path: the draft read the prompt.
    assert all(len(path) > PROBE_CONTEXT for path, _ in p.drafter.calls[1:])


def test_a_job_remembers_a_hopeless_draft():
    memory = DraftMemory()
    _, spec, p = run(0.6, "auto", prompt=LONG_PROMPT, deferred=True, memory=memory)
    assert spec == 1 and memory.hopeless == {"oracle"}
    _, spec, p = run(0.6, "auto", prompt=LONG_PROMPT, deferred=True, memory=memory)
    assert spec == 0 and p.prompt_pass_runs == 0 and p.drafter.calls == []  # not even a probe
    # `always` ignores it; and the memory is per drafter, so another drafter still drafts.
    assert run(0.6, "always", memory=memory)[1] > 10
    memory.hopeless = {"lookup"}
    assert run(0.0, "auto", memory=memory, p=0.99)[1] > 10


def test_the_account():
    e = DraftEconomy()
    assert e.may_draft()  # nothing known yet: draft
    e.single_run(1.0)
    e.new_run()
    e.drafted(0.1)
    e.spent(4 * ROW_IN_BATCH, 4)  # 4 drafted tokens verified
    e.accepted(2)  # only 2 right: 2 saved, 3.42 spent
    assert not e.may_draft() and e.wait == FIRST_INTERVAL and e.pauses == 1 and not e.off
    for _ in range(FIRST_INTERVAL):
        e.single_run(1.0)
    assert e.may_draft() and e.probing  # the probe is judged by its own result
    e.new_run()
    e.drafted(0.1)
    e.spent(3.0, 4)
    e.accepted(1)
    assert not e.may_draft() and e.wait == 2 * FIRST_INTERVAL  # it did not pay: the interval doubles
    assert not e.off
    e.interval = MAX_INTERVAL
    for _ in range(e.wait):
        e.single_run(1.0)
    assert e.may_draft() and e.probing
    e.new_run()
    e.drafted(0.001)  # a lookup that found nothing costs nothing: no pause
    assert e.may_draft() and e.interval == FIRST_INTERVAL and not e.probing


def test_a_draft_that_costs_more_than_any_saving_ends():
    e = DraftEconomy()
    e.single_run(1.0)
    assert e.may_draft()
    e.new_run()
    e.drafted(2.4)  # 4 tokens of a draft at 0.6 of the target
    e.spent(4 * ROW_IN_BATCH, 4)
    e.accepted(4)  # all right, and still 1.72 short: 4 saved, 5.72 spent
    assert not e.may_draft() and e.off
    for _ in range(MAX_INTERVAL + 1):
        e.single_run(1.0)
    assert not e.may_draft()


@pytest.mark.parametrize("sampling", [(), ("--temp", "0.8", "--seed", "7")])
def test_one_rank_on_a_real_model_prints_the_same_tokens_under_either_policy(smollm2_path, sampling):
    """SmolLM2 drafting for itself on one rank: a draft as costly as the target, which `auto` stops
    drafting with (when is the clock's business, not asserted) and `always` keeps drafting with."""
    from test_pipeinfer_mpi import PROMPT, generate

    want = tuple(generate(smollm2_path, "-p", PROMPT, "-n", 48, *sampling)["tokens"])
    common = ("-p", PROMPT, "-n", 48, *sampling, "--mode", "pipeinfer", "--draft", smollm2_path, "--p-accept", "0")
    auto = generate(smollm2_path, *common)
    always = generate(smollm2_path, *common, "--spec-policy", "always")
    assert tuple(auto["tokens"]) == tuple(always["tokens"]) == want
    assert always["runs"]["drafting_paused"] == 0 and always["acceptance"]["drafted"] >= 12
    assert auto["runs"]["speculative"] >= 1  # the first run is always tried: nothing is known before it


def test_a_job_stops_probing_a_draft_that_cannot_pay(smollm2_path, tmp_path):
    """One `bench` job, one rank, SmolLM2 drafting for itself (a draft as costly as the target can
    never pay): the first pipeinfer request probes it from a short context without reading the
    prompt, and the job's later requests do not draft at all. Tokens stay those of iterative."""
    import json
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "pipeinfer_cli", "bench", str(smollm2_path), "--draft", str(smollm2_path),
                        "--ranks", "1", "--threads", "1", "--modes", "iterative,pipeinfer", "--limit", "3", "-n", "24",
                        "--warmup", "0", "--repeat", "1", "--p-accept", "0", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    records = [x for x in json.loads(out.read_text())["records"] if x["mode"] == "pipeinfer"]
    assert [x["runs"]["speculative"] for x in records] == [1, 0, 0]
    assert [x["runs"]["drafting_ended"] for x in records] == [True, True, True]
    assert records[0]["acceptance"]["drafted"] >= 1 and records[0]["runs"]["drafting_paused"] == 1
