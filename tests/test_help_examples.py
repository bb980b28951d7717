"""`--help` as a user copies from it: on an 80-column terminal every example line of every
command's epilog is printed whole, on a line of its own, so a copied example runs."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from pipeinfer_cli.cli.app import app
from pipeinfer_cli.cli.wording import EXAMPLE_WIDTH, epilog

runner = CliRunner()


def _commands(cmd, path: tuple[str, ...] = ()):
    yield path, cmd
    if hasattr(cmd, "commands"):  # a group (Typer 0.29 has a click of its own: no isinstance on click's)
        for name, sub in cmd.commands.items():
            yield from _commands(sub, (*path, name))


COMMANDS = {" ".join(path) or "pipeinfer": (path, cmd.epilog) for path, cmd in _commands(typer.main.get_command(app))
            if cmd.epilog}


def _examples(text: str) -> list[str]:
    return [line.strip() for line in text.split("\n") if line.startswith("  ") and line.strip()]


def test_every_command_that_runs_a_model_has_examples():
    assert {"pipeinfer", "generate", "chat", "serve", "bench", "models"} <= set(COMMANDS)
    assert all(_examples(text) for _, text in COMMANDS.values())


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_examples_are_whole_lines_at_80_columns(name):
    path, text = COMMANDS[name]
    r = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    shown = [line.strip() for line in r.output.splitlines()]
    assert max(len(line.rstrip()) for line in r.output.splitlines()) <= 80  # the help did fit 80 columns
    for example in _examples(text):
        assert example in shown, f"{name} --help wraps this example at 80 columns:\n  {example}"


def test_epilog_keeps_examples_and_reflows_prose():
    text = epilog("""Examples:

  pipeinfer generate a-model \\
      --chat "Hi"

Prose broken
over lines.
""")
    assert text == 'Examples:\n\n  pipeinfer generate a-model \\\n      --chat "Hi"\n\nProse broken over lines.'
    too_wide = [line for _, t in COMMANDS.values() for line in t.split("\n")
                if line.startswith("  ") and len(line) > EXAMPLE_WIDTH]
    assert too_wide == []
