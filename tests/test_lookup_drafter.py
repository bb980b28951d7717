"""The prompt-lookup drafter: longest matches with fallback, confidence from match statistics,
runner-ups from disagreeing occurrences; and, on real prompts, what it proposes and that pipeinfer
with it stays lossless.

The drafter tests are pure (token lists); the grounded-prompt tests replay the SmolLM2 greedy
answer to a shipped grounded prompt through the drafter, and run `pipeinfer bench` on it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeinfer_cli.decode.lookup import HIT_RATE, LookupDrafter, hit_rate, suffix_matches, vote
from pipeinfer_cli.decode.tree import confident


def propose(path, n_max=8, p_min=0.0):
    return LookupDrafter().propose(list(path), n_max, p_min)


# -- matching ----------------------------------------------------------------------------------
def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    # "1 2 3 4" continues with 5 once; later "9 3 4" continues with 7. The path ends "1 2 3 4":
    # the most recent 2-gram "3 4" says 7, the longer 4-gram match says 5.
    path = [1, 2, 3, 4, 5, 6, 9, 3, 4, 7, 8, 1, 2, 3, 4]
    prop = propose(path, n_max=2)
    assert prop.tokens == [5, 6]
    assert suffix_matches(path)[0] == (2, 8)  # most recent first: "3 4" at index 7..8
    assert max(suffix_matches(path)) == (4, 3)


def test_falls_back_to_shorter_matches_down_to_one_token():
    path = [10, 11, 12, 50, 11]  # only the last token occurred before
    prop = propose(path, n_max=3)
    assert prop.tokens == [12, 50, 11]
    assert prop.probs[0] == pytest.approx(hit_rate(1))


def test_no_earlier_occurrence_no_proposal():
    assert propose([1, 2, 3, 4]).tokens == []
    assert propose([7]).tokens == []
    assert propose([1, 2, 1], n_max=0).tokens == []


def test_copies_from_the_generated_text_too():
    prompt = [100, 101, 102]
    generated = [5, 6, 7, 8, 9, 5, 6, 7]  # the answer repeats itself; the prompt has none of it
    assert propose(prompt + generated, n_max=2).tokens == [8, 9]


# -- confidence --------------------------------------------------------------------------------
def test_confidence_grows_with_the_match_length():
    body = list(range(20, 40))
    firsts = []
    for m in range(1, 10):
        path = body + [99] + body[:m]  # the last m tokens match the start of body exactly once
        firsts.append(propose(path, n_max=1).probs[0])
        assert propose(path, n_max=1).tokens == [body[m]]
    assert firsts == sorted(firsts) and firsts[0] < 0.5 < firsts[-1]
    assert firsts[-1] == pytest.approx(HIT_RATE[-1])


def test_probabilities_are_cumulative_along_a_copy():
    body = list(range(20, 40))
    prop = propose(body + [99] + body[:3], n_max=6)
    assert prop.probs == sorted(prop.probs, reverse=True)
    expected = hit_rate(3)
    for k, p in enumerate(prop.probs):
        assert p == pytest.approx(expected)
        expected *= hit_rate(3 + k + 1)
    # pipeinfer launches the leading part above its threshold: a weak match gives a short run.
    assert 0 < confident(prop.probs, 0.5) < len(prop.tokens)


def test_drafting_stops_under_p_min_but_proposes_at_least_one_token():
    body = list(range(20, 40))
    short = propose(body + [99] + body[:1], n_max=6, p_min=0.9)
    assert len(short.tokens) == 1 and short.probs[0] < 0.9
    long = propose(body + [99] + body[:12], n_max=6, p_min=0.5)
    assert len(long.tokens) == 6


def test_disagreeing_occurrences_lower_the_confidence_and_become_runner_ups():
    # "7" was followed by 1, 2 and 1: two votes for 1, one for 2.
    path = [7, 1, 50, 7, 2, 51, 7, 1, 52, 7]
    cands = vote(path, suffix_matches(path))
    assert [c[0] for c in cands] == [1, 2]
    prop = propose(path, n_max=1)
    assert prop.tokens == [1]
    agreeing = propose([7, 1, 50, 7, 1, 51, 7], n_max=1)
    assert prop.probs[0] < agreeing.probs[0]
    assert [t for t, _ in prop.alternatives[0]] == [2]
    assert prop.alternatives[0][0][1] < prop.probs[0]


def test_agreeing_occurrences_raise_the_confidence():
    once = propose([7, 1, 50, 7], n_max=1).probs[0]
    thrice = propose([7, 1, 50, 7, 1, 51, 7, 1, 52, 7], n_max=1).probs[0]
    assert once == pytest.approx(hit_rate(1)) and thrice > once


# -- real prompts --------------------------------------------------------------------------------
def smollm2_answer(model, prompt: list[int], n: int) -> list[int]:
    """SmolLM2's greedy answer, by llama.cpp in this process (the ground truth of the replay)."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(str(model), n_ctx=2048, n_batch=512, n_threads=1, verbose=False)
    llm.eval(prompt)
    out = []
    for _ in range(n):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        out.append(int(np.argmax(logits)))
        llm.eval([out[-1]])
    llm.close()
    return out


def replay(prompt: list[int], answer: list[int], n_draft: int, threshold: float) -> dict:
    """Synchronous speculation replayed against a known answer: runs launched, tokens drafted/accepted."""
    d, i = LookupDrafter(), 0
    st = {"runs": 0, "drafted": 0, "accepted": 0, "failed": 0}
    while i < len(answer):
        prop = d.propose(prompt + answer[:i], n_draft, threshold)
        draft = prop.tokens[:confident(prop.probs, threshold)]
        a = 0
        while a < len(draft) and i + a < len(answer) and answer[i + a] == draft[a]:
            a += 1
        if draft:
            st["runs"] += 1
            st["drafted"] += len(draft)
            st["accepted"] += a
            st["failed"] += a == 0
        i += a + 1
    return st


def test_on_a_grounded_prompt_confident_drafts_are_mostly_right(smollm2_path):
    """SmolLM2 rewriting a shipped grounded prompt's code: at the default threshold most drafted
    tokens are accepted, and far more than when every match is drafted."""
    from pipeinfer_cli.bench.prompts import load_prompts
    from pipeinfer_cli.runtime.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_path)
    p = next(p for p in load_prompts("grounded") if p.id == "docstrings")
    prompt = tok.chat_messages(list(p.messages))
    answer = smollm2_answer(smollm2_path, prompt, 64)
    sure = replay(prompt, answer, 4, 0.5)
    every = replay(prompt, answer, 4, 0.0)
    assert sure["runs"] > 0
    assert sure["accepted"] / sure["drafted"] > 0.8
    assert sure["accepted"] / sure["drafted"] > every["accepted"] / every["drafted"]
    assert sure["failed"] < every["failed"]


@pytest.mark.mpi
def test_pipeinfer_with_lookup_is_lossless_on_grounded_prompts(smollm2_path, tmp_path):
    """Every mode, lookup drafting, trees allowed, 2 ranks, two grounded prompts: identical tokens
    (bench exits 1 otherwise), and the drafter really speculated and was really accepted."""
    out = tmp_path / "b.json"
    cmd = [sys.executable, "-m", "pipeinfer_cli", "bench", str(smollm2_path), "--draft", "lookup", "--ranks", "2",
           "--prompts", "grounded", "--limit", "2", "-n", "48", "--warmup", "0", "--max-branches", "2",
           "--modes", "iterative,speculative,pipeinfer", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["tokens_identical"] and not doc["token_mismatches"]
    recs = [x for x in doc["records"] if x["mode"] == "pipeinfer"]
    assert sum(x["acceptance"]["accepted"] for x in recs) > 0
    assert sum(x["runs"]["speculative"] for x in recs) > 0


def test_draft_min_drops_short_drafts_and_keeps_the_rest():
    """--draft-min / speculative.n_min (decode/min_draft.py): a shorter draft becomes an empty one."""
    from pipeinfer_cli.decode.drafters import Proposal
    from pipeinfer_cli.decode.min_draft import MinLengthDrafter, with_min_length

    class Fixed:
        name = "fixed"

        def __init__(self, n):
            self.n = n

        def propose(self, path, n_max, p_min):
            return Proposal(list(range(self.n)), [0.9] * self.n, [[]] * self.n, source="model")

    assert with_min_length(Fixed(1), 1).__class__ is Fixed  # 0 and 1: any draft, unwrapped
    short, long_ = MinLengthDrafter(Fixed(2), 3), MinLengthDrafter(Fixed(3), 3)
    assert short.propose([1], 8, 0.0).tokens == [] and short.propose([1], 8, 0.0).source == "model"
    assert long_.propose([1], 8, 0.0).tokens == [0, 1, 2]
    assert short.name == "fixed" and not hasattr(short, "request")  # forwarded; stays synchronous
