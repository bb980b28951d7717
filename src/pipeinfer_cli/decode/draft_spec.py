"""What `--draft` asks for, as one typed value: no draft, prompt lookup, a draft model, or both.

The text is parsed once, where the command line is read (`DraftSpec.parse`); every layer below
asks the value (`spec.is_lookup`, `spec.uses_model`, `spec.is_hybrid`) instead of comparing
strings, so adding a kind of draft touches this module and the drafter factory
(`runtime/draft_setup.py`). The forms:

- no `--draft`: `DraftSpec.none()`;
- `lookup`: prompt lookup in the target's own tokens (`decode/lookup.py`), no model;
- `MODEL` (a registry name or a .gguf path): a draft model; its vocabulary decides at load time
  whether it drafts in the target's tokens or through text (`decode/translated.py`);
- `lookup+MODEL`: lookup where it has a confident match, the model elsewhere (`decode/hybrid.py`).

`label` is the draft's name as users read it in tables and JSON (`"lookup"`, the model's label,
`"lookup+" + the model's label`), unchanged from when the draft was a string.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

NONE, LOOKUP, MODEL, HYBRID = "none", "lookup", "model", "hybrid"  # the kinds
HYBRID_PREFIX = LOOKUP + "+"  # --draft lookup+MODEL

_FORMS = "a model name, a .gguf path, lookup or lookup+MODEL"


class DraftSpecError(ValueError):
    """A `--draft` value that names no draft."""


@dataclass(frozen=True)
class DraftSpec:
    """A job's draft: its kind and, for a model, the model as named (then as resolved: its label)."""

    kind: str = NONE
    model: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in (NONE, LOOKUP, MODEL, HYBRID):
            raise DraftSpecError(f"unknown draft kind {self.kind!r}")
        if (self.model is not None) != (self.kind in (MODEL, HYBRID)):
            raise DraftSpecError(f"a {self.kind} draft {'needs' if self.model is None else 'has no'} model")

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
        if text == LOOKUP:
            return cls(LOOKUP)
        if text.startswith(HYBRID_PREFIX):
            model = text[len(HYBRID_PREFIX):].strip()
            if not model or model == LOOKUP or model.startswith(HYBRID_PREFIX):
                raise DraftSpecError(f"--draft {text!r}: after 'lookup+' name a draft model (a registry name or a "
                                     ".gguf path), e.g. --draft lookup+smollm2-135m-instruct")
            return cls(HYBRID, model)
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
    def is_hybrid(self) -> bool:
        """Lookup first, a model elsewhere (`lookup+MODEL`)."""
        return self.kind == HYBRID

    @property
    def uses_model(self) -> bool:
        """Whether a draft model is loaded (alone or behind lookup)."""
        return self.kind in (MODEL, HYBRID)

    @property
    def uses_lookup(self) -> bool:
        """Whether prompt lookup drafts (alone or in front of a model)."""
        return self.kind in (LOOKUP, HYBRID)

    @property
    def label(self) -> str | None:
        """The draft's name in tables and JSON: None, "lookup", MODEL or "lookup+MODEL"."""
        if self.kind == NONE:
            return None
        if self.kind == LOOKUP:
            return LOOKUP
        return (HYBRID_PREFIX if self.kind == HYBRID else "") + self.model

    def __bool__(self) -> bool:
        return self.kind != NONE

    def __str__(self) -> str:
        return self.label or "none"


def is_lookup_label(label: str | None) -> bool:
    """Whether a stored draft label (a profile's or a trace's JSON) names prompt lookup alone."""
    return label == LOOKUP
