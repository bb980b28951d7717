"""A node's model cache for tests whose ranks need (or lack) the model files."""

from __future__ import annotations

import os
from pathlib import Path


def cache_with(tmp_path: Path, name: str, *models: Path) -> Path:
    """A cache directory holding these model files (hard links: no copy)."""
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    for m in models:
        if not (d / m.name).exists():
            os.link(m, d / m.name)
    return d
