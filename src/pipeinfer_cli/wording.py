"""How counts, sizes and help examples are written in everything a user reads.

One plural rule (`1 rank`, `2 ranks`; never `rank(s)`) and one unit convention: decimal units,
kB/MB/GB (1 MB = 1,000,000 bytes), as the README, the download progress bar and pip write them.
"""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """`1 token`, `2 tokens`, `0 tokens`; many: the plural form when it is not word + "s"."""
    return f"{n} {word if n == 1 else many or word + 's'}"


def human_bytes(n: float) -> str:
    """A byte count in decimal units: `512 B`, `3.1 kB`, `98.4 MB`, `1.1 GB`."""
    if abs(n) < 1000:
        return f"{n:.0f} B"
    for unit in ("kB", "MB"):
        n /= 1000
        if abs(round(n, 1)) < 1000:  # 999,960 bytes is 1.0 MB, not 1000.0 kB
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} GB"
