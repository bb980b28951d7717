"""The single top-level error handler: typed errors become one `Error: …` line and exit code 1.

Typed `PipeinferError`s are handled in the root command group, so `typer.testing.CliRunner` sees
exactly what a user sees. Anything else is a bug: `main()` reports it the same way, in one line,
with a traceback only when PIPEINFER_DEBUG is set.
"""

from __future__ import annotations

import traceback

import typer
from typer.core import TyperGroup

try:  # Typer >= 0.22 vendors click as typer._click; older releases use click itself
    from typer._click.exceptions import UsageError as ClickUsageError
except ImportError:  # pragma: no cover - depends on the installed Typer
    from click.exceptions import UsageError as ClickUsageError

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


def usage_message(exc: ClickUsageError) -> str:
    """Click's message for a bad option or argument, in one line, with where to read more."""
    msg = exc.format_message().replace("\n", " ")
    cmd = exc.ctx.command_path if exc.ctx is not None else "pipeinfer"
    return f"{msg} (see `{cmd} --help`)"


class ErrorHandlingGroup(TyperGroup):
    """Root command group that reports the typed errors of any subcommand, once.

    Bad option values (click's UsageError: out of range, wrong type, unknown option) become one
    `Error: …` line with exit status 2 too, instead of a boxed usage message."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except PipeinferError as exc:
            report(exc)
            raise typer.Exit(exc.exit_code) from None
        except ClickUsageError as exc:
            err.print(f"Error: {usage_message(exc)}", markup=False, highlight=False)
            raise typer.Exit(2) from None
