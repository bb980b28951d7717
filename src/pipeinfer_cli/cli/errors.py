"""The single top-level error handler: typed errors become one `Error: …` line and exit code 1.

Typed `PipeinferError`s are handled in the root command group, so `typer.testing.CliRunner` sees
exactly what a user sees. Anything else is a bug: `main()` reports it the same way, in one line,
with a traceback only when PIPEINFER_DEBUG is set.
"""

from __future__ import annotations

import traceback

import typer
from typer.core import TyperGroup

from ..errors import PipeinferError
from .console import debug_enabled, err


def report(exc: BaseException) -> None:
    if debug_enabled():
        err.print("".join(traceback.format_exception(exc)), markup=False, highlight=False)
    if isinstance(exc, PipeinferError):
        msg = str(exc)
    else:
        msg = f"internal error: {type(exc).__name__}: {exc} (set PIPEINFER_DEBUG=1 for a traceback)"
    err.print(f"Error: {msg}", markup=False, highlight=False)


class ErrorHandlingGroup(TyperGroup):
    """Root command group that reports the typed errors of any subcommand, once."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except PipeinferError as exc:
            report(exc)
            raise typer.Exit(1) from None
