"""Output conventions: results on stdout, progress/logs/errors on stderr."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from ..errors import debug_enabled  # noqa: F401 - re-exported for the commands

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def byte_progress() -> Progress:
    """A progress bar in bytes, drawn on stderr (hidden automatically when stderr is not a terminal)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=False,
    )
