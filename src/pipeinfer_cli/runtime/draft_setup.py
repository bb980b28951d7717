"""The drafter the head's modes talk to, in the target's tokens, from what the job loaded.

A draft model on the head (`LlamaDrafter`) or a draft rank's proxy (`RemoteDrafter`), wrapped by
what the job's draft needs: translation through text when its vocabulary is not the target's
(`decode/translated.py`; the draft rank itself only ever sees its own tokens), and prompt lookup in
front of it with `--draft lookup+MODEL` (`decode/hybrid.py`).
"""

from __future__ import annotations

from ..decode.hybrid import HybridAsyncDrafter, HybridDrafter, is_hybrid
from ..decode.translated import TranslatedAsyncDrafter, TranslatedDrafter
from .loading import Loaded
from .remote_draft import RemoteDrafter


def head_drafter(cfg, loaded: Loaded, link):
    """The head's drafter, or None without a draft."""
    topo = loaded.topo
    remote = topo.draft_rank is not None
    drafter = RemoteDrafter(link, topo.draft_rank) if remote else loaded.drafter
    if drafter is None:
        return None
    if loaded.draft_vocab == "translated":
        wrap = TranslatedAsyncDrafter if remote else TranslatedDrafter
        drafter = wrap(drafter, loaded.tokenizer, loaded.draft_tokenizer, cfg.n_ctx,
                       map_alternatives=cfg.decode.max_branches > 1)
    if is_hybrid(cfg.draft_label):
        drafter = (HybridAsyncDrafter if remote else HybridDrafter)(drafter)
    return drafter
