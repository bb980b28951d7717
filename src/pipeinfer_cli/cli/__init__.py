"""The Typer command-line interface. Commands parse options and call library functions."""
