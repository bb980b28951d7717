"""Registry models made here by requantizing another (`kind = "requantize"`): parsing, the file
llama.cpp writes (its types, its size checked, nothing left behind on failure), and `models pull`
making it from a source in the cache."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import gguf
import pytest
from typer.testing import CliRunner

from pipeinfer_cli.cli.app import app
from pipeinfer_cli.errors import DownloadError, RegistryError
from pipeinfer_cli.models.fetch import pull_model
from pipeinfer_cli.models.registry import ModelEntry, ModelSource, load_registry, parse_registry
from pipeinfer_cli.models.requantize import requantize
from tinygguf import write_tiny_model

runner = CliRunner()

SOURCE = 'source = { kind = "wheel-file", package = "pkg", version = "1.0", member = "pkg/a.gguf" }'


def registry_text(source_sha: str, source_size: int, derived_size: int, derived_extra: str = "",
                  qtype: str = "q4_0", base: str = "a") -> str:
    return f"""
default = "a"
[models.a]
arch = "llama"
file = "a.gguf"
size = {source_size}
sha256 = "{source_sha}"
{SOURCE}
[models.a-q]
arch = "llama"
file = "a.Q.gguf"
size = {derived_size}
{derived_extra}
source = {{ kind = "requantize", model = "{base}", type = "{qtype}" }}
"""


def test_the_shipped_q4_0_draft_is_made_from_the_qwen_draft():
    reg = load_registry()
    entry = reg.models["qwen2.5-coder-0.5b-instruct-q4_0"]
    assert entry.source.requantized and entry.source.model == "qwen2.5-coder-0.5b-instruct"
    assert entry.source.type == "q4_0" and entry.sha256 is None and entry.source.packages() == []
    assert entry.arch == reg.models[entry.source.model].arch
    pair = reg.pairs["qwen-coder-q4_0"]
    assert (pair.target, pair.draft) == ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct-q4_0")


def test_parse_a_requantized_entry():
    reg = parse_registry(registry_text("ab" * 32, 10, 5), Path("m.toml"))
    src = reg.models["a-q"].source
    assert (src.kind, src.model, src.type) == ("requantize", "a", "q4_0")
    assert reg.models["a-q"].sha256 is None


@pytest.mark.parametrize("kwargs, message", [
    ({"derived_extra": 'sha256 = "' + "cd" * 32 + '"'}, "models.a-q: a requantized model has no sha256"),
    ({"qtype": "q3_x"}, "models.a-q.source: type must be one of q4_0, "),
    ({"base": "nope"}, "models.a-q.source: model 'nope' is not a model of the registry"),
    ({"base": "a-q"}, "models.a-q.source: model 'a-q' is itself requantized"),
])
def test_malformed_requantized_entries_give_clear_errors(kwargs, message):
    with pytest.raises(RegistryError, match=message.replace("(", r"\(")):
        parse_registry(registry_text("ab" * 32, 10, 5, **kwargs), Path("m.toml"))


def test_a_requantized_entry_of_another_architecture_is_refused():
    text = registry_text("ab" * 32, 10, 5).replace('arch = "llama"\nfile = "a.Q.gguf"', 'arch = "qwen2"\nfile = "a.Q.gguf"')
    with pytest.raises(RegistryError, match="model 'a' is llama, this entry says qwen2"):
        parse_registry(text, Path("m.toml"))


@pytest.fixture
def f32_model(tmp_path) -> Path:
    return write_tiny_model(tmp_path / "src.gguf", n_embd=64, n_ff=128, n_vocab=300)


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("qtype, want", [("q4_0", "Q4_0"), ("q8_0", "Q8_0")])
def test_requantize_writes_the_layers_in_the_type(f32_model, tmp_path, qtype, want):
    out = tmp_path / "out.gguf"
    grown: list[int] = []
    requantize(f32_model, out, qtype, progress=grown.append, threads=1)
    types = _types(out)
    assert types["blk.0.ffn_up.weight"] == want and types["blk.0.attn_q.weight"] == want
    assert types["blk.0.attn_norm.weight"] == "F32"  # norms stay as they are, as llama-quantize leaves them
    assert sum(grown) == out.stat().st_size  # the progress bar reaches the file's size


def test_requantize_is_the_same_bytes_at_any_thread_count(f32_model, tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    requantize(f32_model, a, "q4_0", threads=1)
    requantize(f32_model, b, "q4_0", threads=2)
    assert a.read_bytes() == b.read_bytes()


def test_requantize_of_a_file_llama_cpp_cannot_read_is_one_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(DownloadError, match="llama.cpp could not requantize .* to Q4_0"):
        requantize(bad, tmp_path / "out.gguf", "q4_0", threads=1)


def _entry(size: int) -> ModelEntry:
    return ModelEntry(name="a-q", arch="llama", file="a.Q.gguf", size=size, sha256=None,
                      source=ModelSource(kind="requantize", model="a", type="q4_0"))


def test_pull_makes_the_file_and_checks_its_size(f32_model, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PIPEINFER_CACHE", str(cache))
    ref = tmp_path / "ref.gguf"
    requantize(f32_model, ref, "q4_0", threads=1)
    path = pull_model(_entry(ref.stat().st_size), source_file=f32_model)
    assert path == cache / "a.Q.gguf" and path.read_bytes() == ref.read_bytes()
    assert [p.name for p in cache.iterdir()] == ["a.Q.gguf"]  # no partial file left


def test_a_size_the_registry_does_not_expect_stores_nothing(f32_model, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PIPEINFER_CACHE", str(cache))
    with pytest.raises(DownloadError, match=r"a-q: llama.cpp wrote \d+ bytes requantizing a, expected 12345; nothing was stored"):
        pull_model(_entry(12345), source_file=f32_model)
    assert list(cache.iterdir()) == []


def test_models_pull_makes_it_from_the_source_in_the_cache(f32_model, tmp_path, monkeypatch):
    """`models pull NAME` verifies the source (sha256), requantizes it, and says what it made;
    a second pull only checks the made file, without the source."""
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(f32_model, cache / "a.gguf")
    ref = tmp_path / "ref.gguf"
    requantize(f32_model, ref, "q4_0", threads=1)
    sha = hashlib.sha256(f32_model.read_bytes()).hexdigest()
    registry = tmp_path / "models.toml"
    registry.write_text(registry_text(sha, f32_model.stat().st_size, ref.stat().st_size))
    monkeypatch.setenv("PIPEINFER_CACHE", str(cache))
    monkeypatch.setenv("PIPEINFER_MODELS", str(registry))
    r = runner.invoke(app, ["models", "pull", "a-q"])
    assert r.exit_code == 0, r.output
    assert f"a-q: made from a (requantized to Q4_0) and checked {cache / 'a.Q.gguf'}" in r.stderr
    assert (cache / "a.Q.gguf").read_bytes() == ref.read_bytes()
    (cache / "a.gguf").unlink()  # the source is not needed any more
    r = runner.invoke(app, ["models", "pull", "a-q"])
    assert r.exit_code == 0, r.output
    assert f"a-q: verified {cache / 'a.Q.gguf'}" in r.stderr


def test_a_damaged_source_is_not_requantized(f32_model, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(f32_model, cache / "a.gguf")
    registry = tmp_path / "models.toml"
    registry.write_text(registry_text("ab" * 32, f32_model.stat().st_size, 100))
    monkeypatch.setenv("PIPEINFER_CACHE", str(cache))
    monkeypatch.setenv("PIPEINFER_MODELS", str(registry))
    r = runner.invoke(app, ["models", "pull", "a-q"])
    assert r.exit_code == 1
    assert r.stderr.strip().splitlines()[-1].startswith(f"Error: {cache / 'a.gguf'} has sha256 "), r.stderr
    assert not (cache / "a.Q.gguf").exists()
