"""The single top-level error handler: typed errors become one `Error: …` line and exit code 1.

Typed `PipeinferError`s are handled in the root command group, so `typer.testing.CliRunner` sees
exactly what a user sees. Anything else is a bug: `main()` reports it the same way, in one line,
with a traceback only when PIPEINFER_DEBUG is set.
"""

from __future__ import annotations

import typer
from typer.core import TyperGroup

try:  # Typer >= 0.22 vendors click as typer._click; older releases use click itself
    from typer._click.exceptions import UsageError as ClickUsageError
except ImportError:  # pragma: no cover - depends on the installed Typer
    from click.exceptions import UsageError as ClickUsageError

from ..errors import PipeinferError, debug_enabled, describe, error_line
from .console import err


def report(exc: BaseException) -> None:
    err.print(error_line(describe(exc, traceback_too=debug_enabled())), markup=False, highlight=False)


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
            err.print(error_line(usage_message(exc)), markup=False, highlight=False)
            raise typer.Exit(2) from None
