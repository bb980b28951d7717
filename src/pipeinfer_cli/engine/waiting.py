"""Waiting at the head of an MPI pipeline without spinning, for whatever the decoding policy awaits.

The policies only say what they wait for (a condition); how to wait is the pipeline's business:
here, back off between polls, raise an error another rank reported, and keep the sends moving.
A simulated pipeline waits differently (it advances its virtual time).
"""

from __future__ import annotations

from collections.abc import Callable

from ..transport.mpi_link import Backoff
from .pipeline import Pipeline


def wait_until(pipe: Pipeline, cond: Callable[[], bool]) -> None:
    """Sleep (with backoff, never spinning) until cond() is true; cond polls what it waits for."""
    from .remote_draft import raise_reported_error

    backoff = Backoff()
    while not cond():
        if pipe.link is not None:
            raise_reported_error(pipe.link)
            pipe.link.progress_sends()
        backoff.idle()
