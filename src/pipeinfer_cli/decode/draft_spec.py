"""What `--draft` asks for, as one typed value: no draft, a model-free draft (prompt lookup or
suffix drafting), a draft model, or a model-free draft in front of a model.

The text is parsed once, where the command line is read (`DraftSpec.parse`); every layer below
asks the value (`spec.is_lookup`, `spec.uses_model`, `spec.is_hybrid`) instead of comparing
strings, so adding a kind of draft touches this module and the drafter factory
(`runtime/draft_setup.py`). The forms:

- no `--draft`: `DraftSpec.none()`;
- `lookup`: prompt lookup in the target's own tokens (`decode/lookup.py`), no model;
- `suffix`: suffix drafting (`decode/suffix.py`): the request's tokens and the job's earlier
  requests, no model;
- `MODEL` (a registry name or a .gguf path): a draft model; its vocabulary decides at load time
  whether it drafts in the target's tokens or through text (`decode/translated.py`);
- `lookup+MODEL`, `suffix+MODEL`: the model-free draft where it has a confident match, the model
  elsewhere (`decode/hybrid.py`); `front` names which.

`label` is the draft's name as users read it in tables and JSON (`"lookup"`, `"suffix"`, the
model's label, `"lookup+"` or `"suffix+"` and the model's label), unchanged from when the draft
was a string.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

NONE, LOOKUP, SUFFIX, MODEL, HYBRID = "none", "lookup", "suffix", "model", "hybrid"  # the kinds
FREE = (LOOKUP, SUFFIX)  # the drafts that need no model, alone or in front of one
HYBRID_PREFIX = LOOKUP + "+"  # --draft lookup+MODEL
SUFFIX_PREFIX = SUFFIX + "+"  # --draft suffix+MODEL

_FORMS = "a model name, a .gguf path, lookup, suffix, lookup+MODEL or suffix+MODEL"


class DraftSpecError(ValueError):
    """A `--draft` value that names no draft."""


@dataclass(frozen=True)
class DraftSpec:
    """A job's draft: its kind and, for a model, the model as named (then as resolved: its label);
    for a hybrid, the model-free draft in front of the model (`front`: lookup unless given)."""

    kind: str = NONE
    model: str | None = None
    front: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in (NONE, LOOKUP, SUFFIX, MODEL, HYBRID):
            raise DraftSpecError(f"unknown draft kind {self.kind!r}")
        if (self.model is not None) != (self.kind in (MODEL, HYBRID)):
            raise DraftSpecError(f"a {self.kind} draft {'needs' if self.model is None else 'has no'} model")
        if self.kind == HYBRID and self.front is None:
            object.__setattr__(self, "front", LOOKUP)
        if (self.front is not None) != (self.kind == HYBRID) or self.front not in (None, *FREE):
            raise DraftSpecError(f"a {self.kind} draft has no front {self.front!r}")

    @classmethod
    def none(cls) -> DraftSpec:
        return cls()

    @classmethod
    def lookup(cls) -> DraftSpec:
        return cls(LOOKUP)

    @classmethod
    def parse(cls, text: str | None) -> DraftSpec:
        """The spec of a `--draft` value (None: no draft). DraftSpecError names the accepted forms."""
        if text is None:
            return cls()
        text = text.strip()
        if not text:
            raise DraftSpecError(f"--draft is empty; give {_FORMS}")
        if text in FREE:
            return cls(text)
        for front in FREE:
            if text.startswith(front + "+"):
                model = text[len(front) + 1:].strip()
                if not model or model in FREE or any(model.startswith(f + "+") for f in FREE):
                    raise DraftSpecError(f"--draft {text!r}: after '{front}+' name a draft model (a registry name or a "
                                         f".gguf path), e.g. --draft {front}+smollm2-135m-instruct")
                return cls(HYBRID, model, front)
        return cls(MODEL, text)

    def resolved(self, model_label: str | None) -> DraftSpec:
        """This spec with its model named by its resolved label (a registry name or a path)."""
        return self if self.model is None or model_label is None else replace(self, model=model_label)

    @property
    def is_none(self) -> bool:
        return self.kind == NONE

    @property
    def is_lookup(self) -> bool:
        """Prompt lookup alone: no model to load or lend."""
        return self.kind == LOOKUP

    @property
    def is_suffix(self) -> bool:
        """Suffix drafting alone: no model to load or lend."""
        return self.kind == SUFFIX

    @property
    def is_free(self) -> bool:
        """A model-free draft alone (lookup or suffix): no model to load or lend."""
        return self.kind in FREE

    @property
    def is_hybrid(self) -> bool:
        """A model-free draft first, a model elsewhere (`lookup+MODEL`, `suffix+MODEL`)."""
        return self.kind == HYBRID

    @property
    def uses_model(self) -> bool:
        """Whether a draft model is loaded (alone or behind lookup)."""
        return self.kind in (MODEL, HYBRID)

    @property
    def uses_lookup(self) -> bool:
        """Whether prompt lookup drafts (alone or in front of a model)."""
        return self.free_kind == LOOKUP

    @property
    def uses_suffix(self) -> bool:
        """Whether suffix drafting drafts (alone or in front of a model)."""
        return self.free_kind == SUFFIX

    @property
    def free_kind(self) -> str | None:
        """The model-free draft that drafts, alone or in front of a model: LOOKUP, SUFFIX or None."""
        return self.kind if self.kind in FREE else self.front

    def planned(self) -> DraftSpec:
        """The draft the planner predicts for (`plan`, `calibrate`, `-M auto`): suffix drafting as
        prompt lookup, the model-free draft whose costs and acceptance it can measure."""
        if self.kind == SUFFIX:
            return DraftSpec(LOOKUP)
        return replace(self, front=LOOKUP) if self.kind == HYBRID else self

    @property
    def label(self) -> str | None:
        """The draft's name in tables and JSON: None, "lookup", "suffix", MODEL, "lookup+MODEL" or
        "suffix+MODEL"."""
        if self.kind == NONE:
            return None
        if self.kind in FREE:
            return self.kind
        return (self.front + "+" if self.kind == HYBRID else "") + self.model

    def __bool__(self) -> bool:
        return self.kind != NONE

    def __str__(self) -> str:
        return self.label or "none"


def is_lookup_label(label: str | None) -> bool:
    """Whether a stored draft label (a profile's or a trace's JSON) names prompt lookup alone."""
    return label == LOOKUP
