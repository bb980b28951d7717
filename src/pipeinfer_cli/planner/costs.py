"""What one run costs on one stage, from a profile: the stage's layers times the measured seconds per
layer at the run's rows and KV length, plus its output rows and its fixed cost per run.

Between measured points costs are interpolated linearly (rows, then KV length); beyond the last
measured rows they are extrapolated along the last measured slope, since each further row of a
batch-invariant run costs about what the last one did. Nothing here is fitted to a run.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .profile import CostGrid, RankCosts


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extended along the end slopes; never below a tenth of the
    smallest measured value (a guard against a noisy slope run backwards)."""
    if len(xs) == 1:
        return ys[0] * (x / xs[0] if xs[0] > 0 and x > xs[0] else 1.0)
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, 0.1 * min(ys))


def grid_seconds(grid: CostGrid, rows: int, kv: int) -> float:
    """Seconds per layer for `rows` rows attending to about `kv` cells."""
    per_kv = [_interp(grid.rows, line, rows) for line in grid.s]
    if len(grid.kv) == 1:
        return per_kv[0]
    return _interp(grid.kv, per_kv, kv)


@dataclass
class StageCost:
    """One pipeline stage: a rank's measured costs and the layers it holds."""

    costs: RankCosts
    n_layers: int
    has_output: bool  # the last stage: LM head and sampler for every requested row

    def run_seconds(self, rows: int, n_out: int, kv: int, invariant: bool) -> float:
        grid = self.costs.decode if invariant else self.costs.prefill
        layers = self.n_layers * grid_seconds(grid, rows, kv)
        out = self.costs.output_row_s * n_out if self.has_output else 0.0
        return layers + out + self.costs.run_overhead_s

    def layer_seconds(self, rows: int, kv: int, invariant: bool) -> float:
        """One layer of this run: a cancel that arrives mid-compute stops at the next layer."""
        grid = self.costs.decode if invariant else self.costs.prefill
        return grid_seconds(grid, rows, kv)
