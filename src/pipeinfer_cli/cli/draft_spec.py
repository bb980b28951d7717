"""`--draft` as job commands read it: a model, `lookup`, or `lookup+MODEL` (hybrid drafting)."""

from __future__ import annotations

from ..errors import OptionValueError


def resolve_draft_models(resolve, model: str, draft: str | None, **kw):
    """(target, draft ref, hybrid) through resolve (job_setup.resolve_models) and its keywords:
    with `lookup+MODEL` MODEL is resolved as the draft model and hybrid is True."""
    from ..decode.hybrid import split_hybrid

    if draft is not None and not draft.strip():
        raise OptionValueError("--draft is empty; give a model name, a .gguf path, lookup or lookup+MODEL")
    try:
        hybrid, draft = split_hybrid(draft)
    except ValueError as e:
        raise OptionValueError(str(e)) from None
    target, draft_ref = resolve(model, draft, **kw)
    if hybrid and draft_ref == "lookup":
        raise OptionValueError("--draft lookup+MODEL needs a draft model after 'lookup+', not lookup")
    return target, draft_ref, hybrid


def mark_hybrid(cfg, hybrid: bool):
    """cfg, its draft label saying that lookup goes first (runtime/draft_setup.py reads it)."""
    from ..decode.hybrid import HYBRID_PREFIX

    if hybrid:
        cfg.draft_label = HYBRID_PREFIX + cfg.draft_label
    return cfg
