"""Splitting a model's layers into consecutive ranges, one per pipeline stage."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import UsageError


def balanced_split(layer_costs: Sequence[int], n_ranks: int, last_extra: int = 0,
                   first_extra: int = 0) -> list[tuple[int, int]]:
    """Consecutive layer ranges [begin, end) for n_ranks stages that minimise the largest stage cost,
    and among those the sum of the squared stage costs (the most even of them).

    layer_costs[i] is the cost of layer i (bytes of its weights: decoding is memory-bound, so
    bytes approximate time); last_extra is the cost only the last stage pays (the LM head);
    first_extra is work only the first stage does (a draft model running on the head).
    """
    n_layer = len(layer_costs)
    prefix = [0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def cost(_stage: int, b: int, e: int) -> float:
        return prefix[e] - prefix[b] + (last_extra if e == n_layer else 0) + (first_extra if b == 0 else 0)

    return min_max_split(n_layer, n_ranks, cost)


def min_max_split(n_layer: int, n_ranks: int, cost: Callable[[int, int, int], float]) -> list[tuple[int, int]]:
    """Consecutive ranges [begin, end) for n_ranks stages, stage r holding [b, e) at cost(r, b, e)
    (inf: it cannot, e.g. not enough memory), that minimise the largest stage cost and among those
    the sum of the squared costs (the most even). Stages may differ (measured speeds per rank).
    UsageError when no split is possible."""
    if n_ranks < 1:
        raise UsageError(f"need at least 1 rank, got {n_ranks}")
    if n_ranks > n_layer:
        raise UsageError(f"cannot split {n_layer} layers over {n_ranks} ranks; use at most {n_layer} ranks")
    # best[r][e]: the best (max cost, sum of squared costs) of splitting layers [0, e) into r
    # stages (small sizes: O(R·L²)). Among the splits with the least max cost, the one with the
    # most even stages: with a draft on the head, the head alone sets the max, and the other
    # stages would otherwise be split however the search met them first (one stage with 1 layer).
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n_layer + 1) for _ in range(n_ranks + 1)]
    cut = [[0] * (n_layer + 1) for _ in range(n_ranks + 1)]
    best[0][0] = (0, 0)
    for r in range(1, n_ranks + 1):
        for e in range(r, n_layer + 1):
            for b in range(r - 1, e):
                if best[r - 1][b][0] == float("inf"):
                    continue
                c = cost(r - 1, b, e)
                v = (max(best[r - 1][b][0], c), best[r - 1][b][1] + c * c)
                if v < best[r][e]:
                    best[r][e], cut[r][e] = v, b
    if best[n_ranks][n_layer][0] == float("inf"):
        raise UsageError(f"no split of {n_layer} layers over {n_ranks} ranks fits: some rank has too little memory "
                         "for any share; add a rank or free memory")
    ranges: list[tuple[int, int]] = []
    e = n_layer
    for r in range(n_ranks, 0, -1):
        b = cut[r][e]
        ranges.append((b, e))
        e = b
    return ranges[::-1]


def fractions_of(ranges: Sequence[tuple[int, int]], n_layer: int) -> list[float]:
    """The --layer-split fractions that describe these ranges."""
    return [round((e - b) / n_layer, 4) for b, e in ranges]
