"""The single top-level error handler: typed errors become one `Error: …` line and exit code 1."""

from __future__ import annotations

import traceback

import click
from typer.core import TyperGroup

from ..errors import PipeinferError
from .console import debug_enabled, err


def report(exc: BaseException) -> None:
    if debug_enabled():
        err.print(traceback.format_exc(), markup=False, highlight=False)
    if isinstance(exc, PipeinferError):
        msg = str(exc)
    else:
        msg = f"internal error: {type(exc).__name__}: {exc} (set PIPEINFER_DEBUG=1 for a traceback)"
    err.print(f"Error: {msg}", markup=False, highlight=False)


class ErrorHandlingGroup(TyperGroup):
    """Root command group that catches every error of any subcommand, once."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            err.print("Error: interrupted")
            raise click.exceptions.Exit(130) from None
        except Exception as exc:  # noqa: BLE001 - this is the one place that reports errors
            report(exc)
            raise click.exceptions.Exit(1) from None
