"""How long a run waits between two stages: from "rank r finished run k" to "rank r+1 started run k".

Computed from the ranks' trace events (each on the head's clock through the offset measured at
start). On a fast link this is the transfer plus the receiver's polling delay; a gap that grows on
a slow link, or while the sender drafts or computes, shows a stalled transfer.
"""

from __future__ import annotations

import numpy as np

from ..decode.result import RankReport


def _stage_times(rank: RankReport) -> tuple[dict[int, float], dict[int, float]]:
    """(end, start) of each run's compute or skip on this rank, on the head's clock."""
    off = rank.clock_offset_s or 0.0
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    for kind, name, t0, t1, args in rank.trace or ():
        run = (args or {}).get("run")
        if run is None or name not in ("stage", "skip"):
            continue
        starts.setdefault(run, t0 - off)
        ends[run] = t1 - off
    return ends, starts


def handoff_ms(ranks: list[RankReport], n_stages: int) -> dict:
    """Per link r->r+1 of the target pipeline: median, p90 and max gap in ms, over the runs seen on both."""
    by_rank = {r.rank: _stage_times(r) for r in ranks}
    out = {}
    for r in range(n_stages - 1):
        if r not in by_rank or r + 1 not in by_rank:
            continue
        ends, _ = by_rank[r]
        _, starts = by_rank[r + 1]
        gaps = np.asarray([starts[k] - ends[k] for k in ends if k in starts]) * 1e3
        if len(gaps):
            out[f"{r}->{r + 1}"] = {"p50": round(float(np.percentile(gaps, 50)), 3),
                                    "p90": round(float(np.percentile(gaps, 90)), 3),
                                    "max": round(float(gaps.max()), 3), "runs": int(len(gaps))}
    return out
