"""Translating a draft of another vocabulary (decode/vocab_bridge.py, translated.py) and hybrid
drafting (decode/hybrid.py), on the real tokenizers (vocab-only loads) and scripted drafters."""

from __future__ import annotations

import pytest

from pipeinfer_cli.decode.async_draft import AsyncDraft
from pipeinfer_cli.decode.drafters import Proposal
from pipeinfer_cli.decode.hybrid import LOOKUP_FIRST_P, HybridAsyncDrafter, HybridDrafter
from pipeinfer_cli.decode.translated import TranslatedAsyncDrafter, TranslatedDrafter
from pipeinfer_cli.decode.vocab_bridge import VocabBridge, combine, complete_utf8
from pipeinfer_cli.runtime.tokenizer import Tokenizer
from pipeinfer_cli.runtime.vocab import draft_vocab


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return Tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def gemma(gemma3_path):
    return Tokenizer(gemma3_path)


class ScriptedDraft:
    """A draft model that proposes the draft tokenization of a fixed text's continuation, with p."""

    name = "model"

    def __init__(self, codec, text: bytes, p: float = 0.9):
        self.codec, self.text, self.p = codec, text, p
        self.seen: list[list[int]] = []

    def propose(self, path, n_max, p_min):
        self.seen.append(list(path))
        have = b"".join(self.codec.text_piece(t) for t in path if t != self.codec.bos or not self.codec.add_bos)
        assert self.text.startswith(have), (have, self.text)
        rest = self.codec.encode_bytes(self.text[len(have):], add_bos=False)[:n_max]
        return Proposal(rest, [self.p] * len(rest), [[] for _ in rest])

    def start(self, prompt, reuse=0):
        pass

    def close(self):
        pass


def spell(codec, toks) -> bytes:
    return b"".join(codec.text_piece(t) for t in toks)


def test_the_vocabulary_decision(smol, gemma):
    assert draft_vocab(smol, smol) == "direct"
    assert draft_vocab(smol, gemma) == "translated"


def test_the_draft_sees_its_own_tokenization_of_the_text_as_it_changes(smol, gemma):
    b = VocabBridge(smol, gemma)
    text = "The capital of France is Paris. Hello wonderful world, 東京 😀 naïve café."
    path = smol.encode(text)
    for n in (5, 9, 12, len(path), 7, len(path) - 1, len(path)):  # grow, roll back, grow again
        view = b.draft_view(path[:n])
        want = gemma.encode_bytes(spell(smol, path[:n])[:complete_utf8(spell(smol, path[:n]))], add_bos=True)
        assert view.tokens == want


def test_a_proposal_becomes_target_tokens_that_continue_the_path(smol, gemma):
    full = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n".encode()
    path = smol.encode_bytes(full[:19], add_bos=False)  # ends inside a word's tokens: "def add(a, b):\n   "
    d = TranslatedDrafter(ScriptedDraft(gemma, full), smol, gemma, n_ctx=512)
    prop = d.propose(path, 6, 0.0)
    assert prop.tokens and len(prop.tokens) <= 6
    assert full.startswith(spell(smol, path + prop.tokens))
    assert len(prop.probs) == len(prop.tokens) and all(0 < p <= 1 for p in prop.probs)


def test_a_boundary_inside_a_word(smol, gemma):
    """The path ends with "Hel" (the target's token boundary inside a word): the draft's "lo"
    continues it as the target's own "lo", not as the token "Hello" that would re-spell "Hel"."""
    path = smol.encode_bytes(b"Say hello: Hel", add_bos=False)
    d = TranslatedDrafter(ScriptedDraft(gemma, b"Say hello: Hello world and more"), smol, gemma, n_ctx=512)
    prop = d.propose(path, 4, 0.0)
    assert spell(smol, path + prop.tokens).startswith(b"Say hello: Hello world")


def test_a_path_that_ends_inside_a_character(smol, gemma):
    """SmolLM2 spells an emoji in byte tokens: a path may end after part of it, and the draft
    (whose tokens hold whole characters) must first spell the rest."""
    text = "Look: 😀 great news for everyone".encode()
    toks = smol.encode_bytes(text, add_bos=False)
    cut = next(i for i in range(1, len(toks)) if complete_utf8(spell(smol, toks[:i])) != len(spell(smol, toks[:i])))
    d = TranslatedDrafter(ScriptedDraft(gemma, text), smol, gemma, n_ctx=512)
    prop = d.propose(toks[:cut], 4, 0.0)
    assert prop.tokens and text.startswith(spell(smol, toks[:cut] + prop.tokens))


def test_the_end_of_the_text_maps_to_the_targets_end_token(smol, gemma):
    """SmolLM2 and Qwen share ChatML: the draft's <|im_end|> is the target's. Here the draft is
    SmolLM2 itself behind the bridge (same codec both sides, still translated through text)."""
    path = smol.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello")
    end = smol.encode_bytes(b"<|im_end|>", add_bos=False)
    assert len(end) == 1 and smol.is_eog(end[0])

    class Ends:
        name = "model"

        def propose(self, p, n, pm):
            return Proposal([smol.encode_bytes(b"!", add_bos=False)[0], end[0]], [0.9, 0.8], [[], []])

    prop = TranslatedDrafter(Ends(), smol, smol, n_ctx=512).propose(path, 4, 0.0)
    assert prop.tokens[-1] == end[0] and spell(smol, prop.tokens[:-1]) == b"!"


def test_confidence_combination():
    # one draft token spelling two target tokens: the first carries p, the second is certain after it
    assert combine([6], [0.5], [3, 6]) == [0.5, 1.0]
    # two draft tokens spelling one target token: both must be right
    assert combine([3, 6], [0.5, 0.8], [6]) == [pytest.approx(0.4)]
    # a draft token that only finishes a character the path began gives nothing
    assert combine([0, 4], [0.1, 0.9], [4], n_carry=2) == [0.9]


def test_the_draft_context_is_not_overrun(smol, gemma):
    path = smol.encode("word " * 40)
    d = TranslatedDrafter(ScriptedDraft(gemma, b"word " * 60), smol, gemma, n_ctx=32)
    assert d.propose(path, 4, 0.0).tokens == []


def test_an_async_translated_draft_answers_with_its_base(smol, gemma):
    full = b"one two three four five six seven eight"
    path = smol.encode_bytes(full[:13], add_bos=False)

    class Remote:  # answers at once, like a draft rank that is very fast
        def __init__(self):
            self.inner, self.reply = ScriptedDraft(gemma, full), None

        outstanding = property(lambda self: self.reply is not None)

        def request(self, p, n, pm):
            self.reply = self.inner.propose(p, n, pm)

        def ready(self):
            return self.reply is not None

        def poll(self, whole=False):
            r, self.reply = self.reply, None
            return r

        wait = poll

        def end_stream(self):
            self.reply = None

    d = TranslatedAsyncDrafter(Remote(), smol, gemma, n_ctx=512)
    d.request(path, 3, 0.0)
    assert d.ready()
    prop = d.poll()
    assert prop.base == path and full.startswith(spell(smol, path + prop.tokens)) and prop.tokens


def test_an_empty_reply_is_not_asked_again_for_the_same_path():
    class Empty:
        outstanding, calls = False, 0

        def request(self, p, n, pm):
            self.calls += 1
            self.outstanding = True

        def ready(self):
            return True

        def poll(self, whole=False):
            self.outstanding = False
            return Proposal([], [], [], base=[1, 2])

        def end_stream(self):
            self.outstanding = False

    drafter = Empty()
    ad = AsyncDraft(drafter, 4)
    ad.request([1, 2], 10)
    ad.receive(lambda: [1, 2])
    assert ad.take([1, 2], 0.5, 4) is None
    ad.request([1, 2], 10)
    assert drafter.calls == 1
    ad.request([1, 2, 3], 10)
    assert drafter.calls == 2


# -- hybrid ---------------------------------------------------------------------------------------

class Model:
    name = "model"

    def __init__(self):
        self.calls = 0

    def propose(self, path, n_max, p_min):
        self.calls += 1
        return Proposal([7] * n_max, [0.9] * n_max, [[] for _ in range(n_max)])


def test_hybrid_takes_lookup_where_it_is_confident_and_the_model_elsewhere():
    model = Model()
    h = HybridDrafter(model)
    copied = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 5]  # a long earlier match: lookup continues with 6, 9
    prop = h.propose(copied, 2, 0.0)
    assert prop.source == "lookup" and prop.tokens == [6, 9] and prop.probs[0] >= LOOKUP_FIRST_P
    assert model.calls == 0
    prop = h.propose([1, 2, 3, 8], 2, 0.0)  # no earlier match
    assert prop.source == "model" and prop.tokens == [7, 7] and model.calls == 1


def test_hybrid_in_front_of_a_draft_rank():
    class Remote(Model):
        outstanding = False

        def request(self, p, n, pm):
            self.outstanding, self.n = True, n

        def ready(self):
            return self.outstanding

        def poll(self, whole=False):
            self.outstanding = False
            return Proposal([7] * self.n, [0.9] * self.n, [[]] * self.n)

        wait = poll

        def end_stream(self):
            self.outstanding = False

    remote = Remote()
    h = HybridAsyncDrafter(remote)
    h.request([1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 5], 2, 0.0)
    assert not remote.outstanding and h.ready()
    prop = h.poll()
    assert prop.source == "lookup" and prop.base == [1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 5]
    h.request([1, 2, 3, 8], 2, 0.0)
    assert remote.outstanding
    assert h.poll().source == "model" and not h.outstanding
