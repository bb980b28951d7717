"""What the node cache can give a rank of a model's layers [begin, end), whatever the boundaries of
the files it holds: one cached file that covers the range (the range's own slice, a whole copy of
the model, or any slice whose layers include the range), else the tensors of the range that some
cached files hold, so that the head streams only the rest (transport/weight_transfer.py).

A stage's engine loads only its layers' tensors (and the embedding or LM head its position needs)
from whatever file it is given, so a slice of layers 0-15 serves layers 7-13, and a slice that
ends at the last layer holds the LM head (and, for a tied head, the embedding table) that the
last stage needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from . import slice_cache

_LAYER = re.compile(r"^blk\.(\d+)\.")


def covering_file(model_sha256: str | None, layers: tuple[int, int] | None) -> tuple[Path | None, list[str]]:
    """(path, warnings): one cached file of this model that holds every layer of `layers` (None: the
    whole model), its bytes checked: the range's own slice, else a whole copy, else the smallest
    slice that includes the range. warnings: a line for each cached file found damaged (and removed)."""
    if model_sha256 is None:
        return None, []
    warnings = []
    parts: list[tuple[int, int] | None] = [layers, None] if layers is not None else [None]
    if layers is not None:
        wider = [e for e in slice_cache.list_cached()
                 if e.model_sha256 == model_sha256 and e.layers is not None and e.layers != layers
                 and e.layers[0] <= layers[0] and layers[1] <= e.layers[1]]
        parts += [e.layers for e in sorted(wider, key=lambda e: e.size)]
    for part in parts:
        path, why = slice_cache.lookup(model_sha256, part)
        if why is not None:
            warnings.append(why)
        if path is not None:
            return path, warnings
    return None, warnings


@dataclass(frozen=True)
class TensorCopy:
    """A tensor's bytes in a cached file: `size` bytes at `offset` of `path`."""

    path: Path
    offset: int
    size: int


def cached_tensors(model_sha256: str | None, layers: tuple[int, int] | None) -> dict[str, TensorCopy]:
    """The tensors of layers [begin, end), and those of no layer (embedding, output norm and head),
    that cached files of this model hold, by name. Their bytes are checked when the file they end
    up in is: its sha256 is the head's (transport/weight_transfer.py)."""
    from .. import _native

    if model_sha256 is None or layers is None:
        return {}
    out: dict[str, TensorCopy] = {}
    for entry in slice_cache.list_cached():
        if entry.model_sha256 != model_sha256 or not entry.sha256:
            continue
        try:
            tensors = _native.gguf_metadata(str(entry.path))["tensors"]
        except Exception:  # noqa: BLE001 - a damaged file (the native ModelFileError): its own lookup says so
            continue
        for name, _type, offset, size in tensors:
            m = _LAYER.match(name)
            if (m is None or layers[0] <= int(m.group(1)) < layers[1]) and name not in out:
                out[name] = TensorCopy(entry.path, int(offset), int(size))
    return out
