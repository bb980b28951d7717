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


def report(exc: BaseException, exit_code: int = 1) -> None:
    """Print exc as one `Error: …` line: on a rank of an MPI job that has not started, once for the
    whole job, by its head (transport/startup.py), which also ends every other rank."""
    say(describe(exc, traceback_too=debug_enabled()), exit_code)


def say(message: str, exit_code: int) -> None:
    from ..transport.startup import end_before_start

    end_before_start(message, exit_code)  # returns on the head and outside a job
    err.print(error_line(message), markup=False, highlight=False)


def usage_message(exc: ClickUsageError, parent=None) -> str:
    """Click's message for a bad option or argument, in one line, with where to read more.

    parent: the root group's context, for errors raised while a subcommand's options were still
    being parsed (they carry no context of the subcommand's own)."""
    msg = exc.format_message().replace("\n", " ")
    if exc.ctx is not None and (parent is None or exc.ctx is not parent):
        cmd = exc.ctx.command_path
    elif parent is not None and parent.invoked_subcommand:
        cmd = f"{parent.command_path} {parent.invoked_subcommand}"
    else:
        cmd = "pipeinfer"
    return f"{msg} (see `{cmd} --help`)"


class ErrorHandlingGroup(TyperGroup):
    """Root command group that reports the typed errors of any subcommand, once.

    Bad option values (click's UsageError: out of range, wrong type, unknown option) become one
    `Error: …` line with exit status 2 too, instead of a boxed usage message."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except PipeinferError as exc:
            report(exc, exc.exit_code)
            raise typer.Exit(exc.exit_code) from None
        except ClickUsageError as exc:
            say(usage_message(exc, ctx), 2)
            raise typer.Exit(2) from None
