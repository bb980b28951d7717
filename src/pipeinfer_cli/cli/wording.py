"""How help examples are written (and, re-exported, the one plural rule and unit convention of
../wording.py that every front end uses)."""

from __future__ import annotations

from ..wording import human_bytes, plural  # noqa: F401 - the CLI's modules import them from here

# Typer's help prints an epilog inside a margin of one column on each side, so an example line
# (two spaces of indent included) must fit in this many columns to show whole on an 80-column
# terminal; a longer command is written over several lines, ending each but the last with ` \`.
EXAMPLE_WIDTH = 78


def epilog(text: str) -> str:
    """A command's help epilog from readable source text. A paragraph whose lines are all indented
    is examples: kept line for line (the help never rewraps it at these widths, so a copied
    example runs). Any other paragraph is prose: its lines are joined into one, which the help
    then wraps to the terminal's width (Typer keeps line breaks, so prose broken at 100 columns
    would come out ragged on a narrower terminal)."""
    paragraphs = []
    for para in text.strip("\n").split("\n\n"):
        lines = para.split("\n")
        if all(line.startswith("  ") for line in lines):
            paragraphs.append(para)
        else:
            paragraphs.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(paragraphs)

