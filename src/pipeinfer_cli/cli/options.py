"""Shared option aliases, so every command spells the same option the same way."""

from __future__ import annotations

from typing import Annotated

import typer

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of a table.")]
RanksOption = Annotated[int, typer.Option("--ranks", "-r", min=1, help="Number of pipeline stages (MPI ranks) to plan for.")]
