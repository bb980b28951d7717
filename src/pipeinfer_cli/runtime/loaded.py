"""What one rank holds once its job has loaded (`Loaded`, built by loading.py): the plain record
that the head, the stages, the draft rank and the drafters' set-up read, apart from the loading
itself so that those can name it without importing how it is loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..planner.layout import RankPlan, Topology
from .weight_stream import LoadedWeights

if TYPE_CHECKING:
    from ..decode.drafters import AsyncDrafter, Drafter
    from ..native import LayerEngine
    from .tokenizer import Tokenizer


@dataclass
class Loaded:
    """One rank's loaded state. Fields a rank does not need stay None."""

    topo: Topology
    me: RankPlan
    engine: LayerEngine | None = None  # this rank's layers (target ranks)
    tokenizer: Tokenizer | None = None  # head
    prompts: list[list[int]] = field(default_factory=list)  # token ids of every request (head)
    drafter: Drafter | AsyncDrafter | None = None  # the head's drafter, or the draft rank's model
    draft_vocab: str | None = None  # head: "direct" or "translated" (runtime/vocab.py); None without a draft
    draft_tokenizer: Tokenizer | None = None  # head, translated drafts: the draft's tokenizer
    weights: LoadedWeights | None = None  # where this rank's weights came from (runtime/weight_stream.py)
