"""The figures every benchmark computes the same way: medians (of prompts, of repeated runs) with
their spread, ratios paired by prompt, a bench document's measured records."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values given (None and 0 left out), or None."""
    xs = [v for v in values if v]
    return statistics.median(xs) if xs else None


def spread(values: Iterable[float | None], digits: int = 4) -> dict | None:
    """{median, min, max, n} of the values given (None left out), or None: how a figure of
    repeated runs is reported."""
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    return {"median": round(statistics.median(xs), digits), "min": round(min(xs), digits),
            "max": round(max(xs), digits), "n": len(xs)}


def per_prompt(records: Iterable[dict], key: str = "tok_per_s") -> dict[str, float]:
    """{prompt: median of key over the records of that prompt}."""
    groups: dict[str, list[float]] = {}
    for r in records:
        if r.get(key):
            groups.setdefault(r["prompt_id"], []).append(r[key])
    return {p: statistics.median(v) for p, v in groups.items()}


def paired_ratio(a: dict[str, float], b: dict[str, float]) -> float | None:
    """a over b paired by prompt: the geometric mean over the prompts of both of a/b."""
    rs = [a[p] / b[p] for p in a if p in b and a[p] > 0 and b[p] > 0]
    return math.exp(statistics.fmean(math.log(x) for x in rs)) if rs else None


def measured(doc: dict | None) -> list[dict]:
    """The records of a `pipeinfer bench` document without its warm-up rounds."""
    return [r for r in (doc or {}).get("records", []) if not r.get("warmup")]


def first_difference(a: list[int], b: list[int]) -> int:
    """The index of the first token where two texts differ (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
