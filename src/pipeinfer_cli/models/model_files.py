"""Turn what the user typed for a model (registry name, pair name or .gguf path) into a checked file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .cache import cached_model_path
from ..errors import ModelFileError, UnknownModelError
from .registry import ModelEntry, Registry

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelRef:
    """A model argument resolved to a file."""

    label: str  # registry name, or the path as given
    path: Path | None  # None: not on this node (a rank other than the head is sent it: runtime/weight_stream.py)
    entry: ModelEntry | None  # None for a local path


def looks_like_path(spec: str) -> bool:
    return spec.endswith(".gguf") or "/" in spec or Path(spec).exists()


def check_gguf_file(path: Path) -> None:
    """Cheap structural check: the file exists, starts with the GGUF magic, and its header parses."""
    if not path.exists():
        raise ModelFileError(f"model file {path} does not exist; pass a .gguf path or a registry name (see `pipeinfer models list`)")
    if not path.is_file():
        raise ModelFileError(f"{path} is not a file; pass a .gguf model file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF'); convert it with llama.cpp's convert_hf_to_gguf.py")


def resolve_model(spec: str, registry: Registry, missing_ok: bool = False) -> ModelRef:
    """Resolve a model name or path. Registry models must have been pulled already.

    missing_ok: a model that is not on this node resolves to a ModelRef without a path (a rank
    other than the head, which is sent its weights)."""
    if spec in registry.models:
        entry = registry.models[spec]
        path = cached_model_path(entry)
        if not path.exists():
            if missing_ok:
                return ModelRef(spec, None, entry)
            raise ModelFileError(f"model {spec!r} is not downloaded; run `pipeinfer models pull {spec}`")
        return ModelRef(spec, path, entry)
    if spec in registry.pairs:
        raise UnknownModelError(f"{spec!r} is a target/draft pair, not a single model; use {registry.pairs[spec].target!r} or {registry.pairs[spec].draft!r}")
    if looks_like_path(spec):
        path = Path(spec).expanduser()
        if missing_ok and not path.exists():
            return ModelRef(spec, None, None)
        check_gguf_file(path)
        return ModelRef(spec, path, None)
    registry.model(spec)  # raises the "unknown model" error listing the known names
    raise AssertionError("unreachable")
