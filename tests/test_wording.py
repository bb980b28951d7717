"""One plural rule and one unit convention in everything a user reads: `1 rank`, `2 ranks` (never
`rank(s)`), and sizes in decimal MB/GB as the README and the download bar write them."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console
from typer.testing import CliRunner

from pipeinfer_cli.bench.results import BenchResults
from pipeinfer_cli.cli.app import app
from pipeinfer_cli.wording import human_bytes, plural

runner = CliRunner()


@pytest.mark.parametrize("n, word, want", [(0, "rank", "0 ranks"), (1, "rank", "1 rank"), (2, "thread", "2 threads"),
                                           (1, "repeat", "1 repeat"), (3, "branch", "3 branches")])
def test_plural(n, word, want):
    assert plural(n, word, "branches" if word == "branch" else None) == want


@pytest.mark.parametrize("n, want", [(0, "0 B"), (999, "999 B"), (1000, "1.0 kB"), (6144, "6.1 kB"),
                                     (999_960, "1.0 MB"), (98_362_432, "98.4 MB"), (491_400_064, "491.4 MB"),
                                     (1_117_320_768, "1.1 GB"), (75_497_472, "75.5 MB"), (4_000_000, "4.0 MB")])
def test_human_bytes_is_decimal(n, want):
    assert human_bytes(n) == want


def _table(monkeypatch, module, args) -> str:
    term = Console(file=io.StringIO(), force_terminal=True, width=160, color_system=None)
    monkeypatch.setattr(module, "out", term)
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    return term.file.getvalue()


def test_models_list_sizes_match_the_readme(monkeypatch):
    """The model table of docs/models.md says 98 MB and 1.1 GB; the list says the same in the same units."""
    from pipeinfer_cli.cli import models_cmd

    table = _table(monkeypatch, models_cmd, ["models", "list"])
    assert re.search(r"smollm2-135m-instruct.*│\s+98\.4 MB │", table), table
    assert re.search(r"qwen2\.5-coder-1\.5b-instruct\s.*│\s+1\.1 GB │", table), table
    assert "MiB" not in table and "GiB" not in table


def test_inspect_uses_decimal_units_and_plurals(monkeypatch, tiny_llama):
    from pipeinfer_cli.cli import inspect_cmd

    text = _table(monkeypatch, inspect_cmd, ["inspect", str(tiny_llama), "--ranks", "1"])
    assert "layer split for 1 rank:" in text, text
    assert "KiB" not in text and "MiB" not in text and " kB" in text


def test_bench_title_plurals():
    header = {"models": {"target": {"name": "m"}, "draft": None},
              "topology": {"world_size": 1, "ranks": [{"threads": 1, "layers": [0, 30]}]},
              "config": {"n_predict": 8, "prompts": {"count": 1}, "repeat": 1}}
    res = BenchResults(modes=["iterative"], records=[], mismatches=[], summary={}, header=header)
    assert res.title().endswith("· 1 rank, layers 0-29, threads 1 · -n 8 · 1 prompt × 1 repeat")
    header["topology"]["world_size"], header["config"]["prompts"]["count"], header["config"]["repeat"] = 2, 8, 3
    assert "· 2 ranks, " in res.title() and res.title().endswith("8 prompts × 3 repeats")
