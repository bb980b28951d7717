"""Can this draft model speculate for this target? Only if they share a tokenizer."""

from __future__ import annotations

from ..errors import UsageError

VOCAB_SLACK = 128  # llama.cpp's speculative example tolerates this many extra (padding) tokens


def check_vocab_compatible(target_tok, draft_tok, target_label: str, draft_label: str) -> None:
    """Refuse a draft whose vocabulary differs from the target's, as llama.cpp's speculative does.

    Both arguments have `n_vocab` and `token_text(id)`: a tokenizer.Tokenizer (a vocab-only load)
    or a drafters.LlamaDrafter (the loaded draft model)."""
    n_t, n_d = target_tok.n_vocab, draft_tok.n_vocab
    if abs(n_t - n_d) > VOCAB_SLACK:
        raise UsageError(
            f"draft {draft_label} has a vocabulary of {n_d} tokens but target {target_label} has {n_t}; "
            "the draft must share the target's tokenizer (pick a model of the same family)"
        )
    for i in range(5, min(n_t, n_d)):
        if target_tok.token_text(i) != draft_tok.token_text(i):
            raise UsageError(
                f"draft {draft_label} and target {target_label} tokenize differently (token {i} differs); "
                "the draft must share the target's tokenizer"
            )
