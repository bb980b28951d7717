"""`--draft` as job commands read it: parsed once into a `DraftSpec` (`decode/draft_spec.py`): a
model, `lookup`, or `lookup+MODEL` (hybrid drafting); cli/job_setup.resolve_models resolves its model."""

from __future__ import annotations

from ..decode.draft_spec import DraftSpec, DraftSpecError
from ..errors import OptionValueError


def parse_draft(text: str | None) -> DraftSpec:
    """The DraftSpec of a --draft value; a bad one is an OptionValueError naming the accepted forms."""
    try:
        return DraftSpec.parse(text)
    except DraftSpecError as e:
        raise OptionValueError(str(e)) from None

