"""Clock offsets between ranks, so that every rank's trace events land on the head's time axis."""

from __future__ import annotations

import time

from .messages import Tag
from .mpi_link import Link

N_PROBES = 5


def clock_offsets(link: Link) -> list[float]:
    """Offset of each rank's perf_counter from the head's (NTP-style, best of N_PROBES round trips).

    Called by every rank at once; returns the offsets on the head, [] elsewhere."""
    if link.size == 1:
        return [0.0]
    if link.rank != 0:
        for _ in range(N_PROBES):
            link.recv_pickled(0, Tag.CLOCK)
            link.send_pickled(time.perf_counter(), 0, Tag.CLOCK)
            link.flush()
        return []
    offsets = [0.0]
    for r in range(1, link.size):
        best = None
        for _ in range(N_PROBES):
            t0 = time.perf_counter()
            link.send_pickled(None, r, Tag.CLOCK)
            t_r = link.recv_pickled(r, Tag.CLOCK)
            t1 = time.perf_counter()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, t_r - (t0 + t1) / 2)
        offsets.append(best[1])
    link.flush()
    return offsets
