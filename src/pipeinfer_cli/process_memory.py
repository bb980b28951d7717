"""This process's memory, as every layer reports it (a rank's report, the weight stream's)."""

from __future__ import annotations

import resource


def peak_rss_mib() -> float:
    """The process's peak resident memory so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB
