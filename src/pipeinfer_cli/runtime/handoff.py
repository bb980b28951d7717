"""The traffic of one request (`wire_summary`: bytes and messages per link, each rank's time
waiting), and how long a run waits between two stages: from "rank r finished run k" to "rank r+1
started run k".

Computed from the ranks' trace events (each on the head's clock through the offset measured at
start). On a fast link this is the transfer plus the receiver's polling delay; a gap that grows on
a slow link, or while the sender drafts or computes, shows a stalled transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class WireSummary:
    """The "wire" object of a result (docs/json-output.md)."""

    links: list[dict]  # {"from", "to", "bytes", "messages", "bytes_per_token", "messages_per_token"}
    head_received_bytes_per_token: float
    head_received_bytes_per_row: float | None
    wait_s: dict[str, float]  # per rank (its number as a string)
    handoff_ms: dict[str, dict[str, float]]  # per link "r->r+1": p50, p90, max, runs

    def as_dict(self) -> dict:
        return {"links": self.links, "head_received_bytes_per_token": self.head_received_bytes_per_token,
                "head_received_bytes_per_row": self.head_received_bytes_per_row, "wait_s": self.wait_s,
                "handoff_ms": self.handoff_ms}


def wire_summary(ranks: list[RankReport], n_gen: int, n_stages: int) -> WireSummary:
    """Bytes and messages per link (array payloads: run headers, hidden states, results, KV
    operations, cancels, draft requests), per generated token, each rank's time waiting, and the
    gaps between stages."""
    per = max(n_gen, 1)
    links = []
    for r in ranks:
        for dest, row in (r.wire or {}).get("sent", {}).items():
            links.append({"from": r.rank, "to": int(dest), "bytes": row["bytes"], "messages": row["messages"],
                          "bytes_per_token": round(row["bytes"] / per, 1),
                          "messages_per_token": round(row["messages"] / per, 2)})
    head_in = sum(row["bytes"] for row in ((ranks[0].wire or {}).get("received") or {}).values())
    rows = ranks[0].rows_requested or 0
    return WireSummary(links, round(head_in / per, 1), round(head_in / rows, 1) if rows else None,
                       {str(r.rank): (r.wire or {}).get("wait_s", 0.0) for r in ranks}, handoff_ms(ranks, n_stages))


def handoff_ms(ranks: list[RankReport], n_stages: int) -> dict[str, dict[str, float]]:
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
