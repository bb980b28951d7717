"""Output conventions: results on stdout, progress/logs/errors on stderr."""

from __future__ import annotations

import os

from rich.console import Console
from rich.measure import Measurement
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

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


def print_table(table: Table, console: Console = out) -> None:
    """A table on `console`, whole: on a terminal (or with COLUMNS set) at its width, as rich fits
    it; piped, at the table's own width, so that no cell is cut to `…` by rich's 80 columns default."""
    if console.is_terminal or os.environ.get("COLUMNS"):
        console.print(table)
        return
    wide = console.options.update_width(1 << 16)
    need = Measurement.get(console, wide, table).maximum
    saved = console._width
    console.width = max(console.width, need)
    try:
        console.print(table)
    finally:
        console._width = saved
