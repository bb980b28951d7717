"""How a draft model's tokens reach the target: directly, or translated through text.

Same vocabulary (as llama.cpp's speculative example decides it: sizes within `VOCAB_SLACK` and the
same entries) → "direct": the draft's tokens are the target's. Otherwise → "translated"
(decode/vocab_bridge.py): the draft's proposals are re-tokenized for the target, which needs both
tokenizers to spell text back byte for byte; one that does not is refused here, with one line.
"""

from __future__ import annotations

from ..errors import UsageError

VOCAB_SLACK = 128  # llama.cpp's speculative example tolerates this many extra (padding) tokens

# Text a translated draft must spell back exactly, as both sides tokenize it: ASCII and code,
# whitespace runs, accented Latin, CJK, an emoji (4 UTF-8 bytes), and a mid-text start.
PROBE_TEXTS = ("def f(x):\n\treturn x  # ok\n\n", "Café naïve — 東京, 日本語 😀 ok", "abc def")


def draft_vocab(target_tok, draft_tok) -> str:
    """"direct" if the draft shares the target's vocabulary, else "translated".

    Both arguments have `n_vocab` and `token_text(id)`: a tokenizer.Tokenizer (a vocab-only load)
    or a drafters.LlamaDrafter (the loaded draft model)."""
    n_t, n_d = target_tok.n_vocab, draft_tok.n_vocab
    if abs(n_t - n_d) > VOCAB_SLACK:
        return "translated"
    same = all(target_tok.token_text(i) == draft_tok.token_text(i) for i in range(5, min(n_t, n_d)))
    return "direct" if same else "translated"


def check_translatable(target_tok, draft_tok, target_label: str, draft_label: str) -> None:
    """Refuse a translated draft whose text cannot be re-tokenized for the target: a tokenizer
    (the draft's or the target's) whose tokens do not spell the text they came from byte for byte
    (one that adds a space in front, lowercases, or has no token for some bytes)."""
    for tok, label, other in ((draft_tok, f"draft {draft_label}", f"target {target_label}"),
                              (target_tok, f"target {target_label}", f"draft {draft_label}")):
        for text in PROBE_TEXTS:
            raw = text.encode()
            spelled = b"".join(tok.text_piece(t) for t in tok.encode_bytes(raw, add_bos=False))
            if spelled != raw:
                raise UsageError(
                    f"{label} has another vocabulary than {other} and its tokenizer does not spell text back byte "
                    f"for byte ({text[:24]!r} comes back as {spelled.decode('utf-8', 'replace')[:24]!r}), so drafts "
                    "cannot be translated between them; pick a draft of the target's family or a byte-level BPE model")
