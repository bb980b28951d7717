"""Suffix drafting (`--draft suffix`): the suffix automaton (appends, take-backs, counts, longest
matches), the corpus of earlier requests (learning, document boundaries, the memory cap), the
drafter's proposals (frequency confidence, length adapting to the match, runner-ups), and the job
wiring (the head's corpus, parallel slots, suffix+MODEL). Pure: token lists, no model."""

from __future__ import annotations

import random
import threading

import pytest

from pipeinfer_cli.decode.drafters import Proposal
from pipeinfer_cli.decode.hybrid import LOOKUP_FIRST_P, HybridAsyncDrafter, HybridDrafter
from pipeinfer_cli.decode.lookup import hit_rate
from pipeinfer_cli.decode.suffix import SPEC_FACTOR, SuffixDrafter, confidence
from pipeinfer_cli.decode.suffix_automaton import SuffixAutomaton
from pipeinfer_cli.decode.suffix_corpus import SuffixCorpus


def occurrences(text: list[int], s: list[int]) -> list[int]:
    """End positions of s in text, by brute force."""
    return [i + len(s) - 1 for i in range(len(text) - len(s) + 1) if text[i:i + len(s)] == s]


def state_of(sam: SuffixAutomaton, s: list[int]) -> int | None:
    v = 0
    for t in s:
        v = sam.trans[v].get(t)
        if v is None:
            return None
    return v


# -- the automaton ---------------------------------------------------------------------------
def test_incremental_appends_count_every_substring_exactly():
    rng = random.Random(1)
    for _ in range(40):
        sam, text = SuffixAutomaton(), []
        for _ in range(50):
            text.append(rng.randint(0, 3))
            sam.append(text[-1])
            i = rng.randrange(len(text))
            j = rng.randint(i + 1, len(text))
            v = state_of(sam, text[i:j])
            ends = occurrences(text, text[i:j])
            assert v is not None and sam.occ[v] == len(ends) and sam.recent[v] == max(ends)
        assert state_of(sam, [9]) is None  # never appended


def test_taking_tokens_back_leaves_the_automaton_of_the_shorter_text():
    rng = random.Random(2)
    for _ in range(40):
        sam, text = SuffixAutomaton(undo=True), []
        for _ in range(60):
            if text and rng.random() < 0.35:
                k = rng.randint(1, min(6, len(text)))
                sam.truncate(len(text) - k)
                del text[-k:]
            else:
                text.append(rng.randint(0, 2))
                sam.append(text[-1])
            fresh = SuffixAutomaton()
            fresh.extend(text)
            assert (sam.trans, sam.link, sam.length, sam.occ) == (fresh.trans, fresh.link, fresh.length, fresh.occ)
            assert len(sam) == len(text)


def test_longest_match_of_a_query_and_the_longest_earlier_repeat():
    sam = SuffixAutomaton()
    text = [1, 2, 3, 4, 5, 9, 3, 4, 7, 1, 2, 3, 4]
    sam.extend(text)
    v, m = sam.match([8, 8, 2, 3, 4])  # "2 3 4" occurs, "8 2 3 4" does not
    assert m == 3 and sorted(occurrences(text, [2, 3, 4])) == [3, 12] and sam.occ[v] == 2
    assert sam.match([8, 8]) == (0, 0)
    v, m = sam.repeat()  # the text ends "1 2 3 4", which occurred at its start
    assert m == 4 and sam.occ[v] == 2
    rng = random.Random(3)
    for _ in range(200):
        text = [rng.randint(0, 3) for _ in range(rng.randint(1, 30))]
        sam = SuffixAutomaton()
        sam.extend(text)
        want = max([m for m in range(1, len(text)) if len(occurrences(text, text[-m:])) >= 2], default=0)
        assert sam.repeat()[1] == want


def test_documents_do_not_run_into_each_other():
    sam = SuffixAutomaton()
    sam.extend([1, 2, 3])
    sam.end_document()
    sam.extend([4, 5])
    sam.end_document()
    assert sam.match([3, 4])[1] == 1  # "3 4" spans the boundary: only "4" matches
    kids, total = sam.children(state_of(sam, [3]))
    assert kids == [] and total == 1  # "3" ended its document: followed by nothing proposable


# -- proposals ---------------------------------------------------------------------------------
def propose(path, n_max=8, p_min=0.0, corpus=None) -> Proposal:
    return SuffixDrafter(corpus).propose(list(path), n_max, p_min)


def test_continues_the_longest_earlier_match():
    path = [1, 2, 3, 4, 5, 6, 9, 3, 4, 7, 8, 1, 2, 3, 4]
    assert propose(path, n_max=2).tokens == [5, 6]  # "1 2 3 4" -> 5, not the recent "3 4" -> 7
    assert propose([1, 2, 3, 4]).tokens == []  # nothing repeats
    assert propose([7], n_max=3).tokens == [] and propose([1, 2, 1], n_max=0).tokens == []


def test_the_most_frequent_continuation_wins_and_the_others_are_runner_ups():
    # "7" was followed by 1, 2, 1: the majority (1) wins over the most recent (2).
    path = [7, 1, 50, 7, 2, 51, 7, 1, 52, 7]
    prop = propose(path, n_max=1)
    assert prop.tokens == [1]
    assert [t for t, _ in prop.alternatives[0]] == [2]
    assert prop.probs[0] == pytest.approx(confidence(2, 3, 1))
    assert prop.alternatives[0][0][1] == pytest.approx(confidence(1, 3, 1))
    assert prop.alternatives[0][0][1] < prop.probs[0]
    # Equal counts: the most recent occurrence decides.
    assert propose([7, 1, 50, 7, 2, 51, 7], n_max=1).tokens == [2]


def test_confidence_grows_with_agreeing_occurrences_and_match_length():
    once = propose([7, 1, 50, 7], n_max=1).probs[0]
    thrice = propose([7, 1, 50, 7, 1, 51, 7, 1, 52, 7], n_max=1).probs[0]
    assert once == pytest.approx(hit_rate(1)) and thrice > once
    body = list(range(20, 60))
    firsts = [propose(body + [99] + body[:m], n_max=1).probs[0] for m in range(1, 10)]
    assert firsts == sorted(firsts) and firsts[0] < 0.5 < firsts[-1]


def test_probabilities_are_cumulative_and_cut_at_p_min():
    body = list(range(20, 60))
    prop = propose(body + [99] + body[:6], n_max=6)
    expected = 1.0
    for k, p in enumerate(prop.probs):
        expected *= confidence(1, 1, 6 + k)
        assert p == pytest.approx(expected)
    short = propose(body + [99] + body[:1], n_max=6, p_min=0.9)
    assert len(short.tokens) == 1 and short.probs[0] < 0.9  # at least one token, as lookup


def test_the_draft_length_adapts_to_the_match_length():
    body = list(range(20, 80))
    for m in (1, 2, 3, 5, 8):
        prop = propose(body + [99] + body[:m], n_max=32)
        assert len(prop.tokens) == min(32, int(SPEC_FACTOR * m))
        assert prop.tokens == body[m:m + len(prop.tokens)]


def test_a_rolled_back_path_drafts_as_a_fresh_drafter_does():
    rng = random.Random(4)
    d = SuffixDrafter()
    base = [rng.randint(0, 5) for _ in range(40)]
    d.start(base[:20])
    for _ in range(60):
        path = base[:rng.randint(1, 40)] + [rng.randint(0, 5) for _ in range(rng.randint(0, 4))]
        assert d.propose(path, 6, 0.0) == propose(path, 6, 0.0)


# -- learning across requests ------------------------------------------------------------------
def test_earlier_requests_are_drafted_from():
    corpus = SuffixCorpus()
    answer = list(range(100, 140))
    corpus.add([1, 2, 3] + answer)  # an earlier request: prompt, then its answer
    prompt = [5, 6, 1, 2, 3]  # a new request asking the same
    alone = propose(prompt, n_max=8)
    learnt = propose(prompt + answer[:4], n_max=8, corpus=corpus)
    assert alone.tokens == []
    assert learnt.tokens == answer[4:11]  # a 7-token match ("1 2 3" and 4 answer tokens): 7 tokens
    # The request's own text and the corpus both match: the stronger proposal wins.
    d = SuffixDrafter(corpus)
    assert d.propose(prompt + answer[:10], 8, 0.0).tokens == answer[10:18]


def test_the_corpus_keeps_at_most_its_cap_dropping_the_oldest():
    corpus = SuffixCorpus(cap=100)
    docs = [[1000 * i + k for k in range(30)] for i in range(10)]
    for i, doc in enumerate(docs):
        corpus.add(doc)
        assert len(corpus) <= 100
        assert sum(len(d) for d in corpus.docs) == len(corpus)
    assert corpus.n_learnt == 10 and corpus.n_dropped > 0
    kept = list(corpus.docs)
    assert kept == docs[-len(kept):]  # the newest, in order
    d = SuffixDrafter(corpus)
    assert d.propose(docs[-1][:5], 4, 0.0).tokens == docs[-1][5:9]  # the newest is still there
    assert d.propose(docs[0][:5], 4, 0.0).tokens == []  # the oldest is gone
    # Its automaton holds exactly what is kept: about two states per token at most.
    assert corpus.sam.n_states <= 2 * (len(corpus) + len(kept)) + 1
    big = SuffixCorpus(cap=50)
    big.add(list(range(500, 700)))  # one request over the cap keeps its end
    assert len(big) <= 50 and big.docs[-1] == list(range(500, 700))[-len(big.docs[-1]):]


def test_the_corpus_takes_requests_while_others_draft_from_it():
    corpus = SuffixCorpus(cap=2000)
    rng = random.Random(5)
    docs = [[rng.randint(0, 50) for _ in range(200)] for _ in range(30)]
    errors = []

    def draft():
        try:
            d = SuffixDrafter(corpus)
            for doc in docs:
                d.propose(doc[:50], 8, 0.0)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=draft)
    t.start()
    for doc in docs:
        corpus.add(doc)
    t.join()
    assert not errors and len(corpus) <= 2000


# -- the job's wiring --------------------------------------------------------------------------
def test_the_head_keeps_one_corpus_per_job_and_hybrids_share_it():
    from pipeinfer_cli.runtime.draft_setup import fallback_drafter, suffix_corpus

    corpus = SuffixCorpus()
    d = SuffixDrafter(corpus)
    assert suffix_corpus(d) is corpus
    assert suffix_corpus(HybridDrafter(object(), d)) is corpus
    assert suffix_corpus(HybridDrafter(object())) is None  # lookup in front
    from pipeinfer_cli.decode.draft_spec import DraftSpec

    fb = fallback_drafter(DraftSpec.parse("suffix+m"), corpus)
    assert isinstance(fb, SuffixDrafter) and fb.corpus is corpus
    assert fallback_drafter(DraftSpec.parse("lookup+m"), corpus).name == "lookup"


def test_parallel_requests_each_get_a_suffix_drafter_on_the_jobs_corpus():
    from pipeinfer_cli.decode.draft_spec import DraftSpec
    from pipeinfer_cli.runtime.parallel import DraftLease

    corpus = SuffixCorpus()
    lease = DraftLease(SuffixDrafter(corpus), DraftSpec.parse("suffix"), threading.Lock())
    (a, _, held_a), (b, _, held_b) = lease.take(0, 0), lease.take(1, 0)
    assert a is not b and a.corpus is b.corpus is corpus and not held_a and not held_b and not lease.lent


class _Model:
    name = "model"
    has_prompt_pass = False
    kv_tokens: list[int] = []

    def __init__(self):
        self.asked = 0

    def start(self, prompt, reuse=0):
        pass

    def propose(self, path, n_max, p_min):
        self.asked += 1
        return Proposal([42], [0.9], [[]])


def test_suffix_plus_model_drafts_from_suffix_where_it_is_confident():
    body = list(range(20, 60))
    model = _Model()
    h = HybridDrafter(model, SuffixDrafter(SuffixCorpus()))
    assert h.name == "suffix+model" and h.front_name == "suffix"
    sure = h.propose(body + [99] + body[:8], 4, 0.0)
    assert sure.source == "suffix" and sure.tokens == body[8:12] and sure.probs[0] >= LOOKUP_FIRST_P
    unsure = h.propose([1, 2, 3], 4, 0.0)
    assert unsure.source == "model" and unsure.tokens == [42] and model.asked == 1
    a = HybridAsyncDrafter(model, SuffixDrafter())
    assert a.free_draft(body + [99] + body[:8], 0.5, 4) == body[8:12]
