"""Gemma 3 270M (the real file): the native engine decodes what llama.cpp decodes, including a
prompt longer than the 512-position sliding window of its local layers."""

from __future__ import annotations

import numpy as np
import pytest

from pipeinfer_cli.native import LayerEngine
from test_native_parity import assert_parity, llama_cpp_greedy, native_greedy, open_stages

N_LAYER = 18
PROMPTS = {
    "capital": b"The capital of France is",
    "code": b"def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
}


def tokenize(path, text: bytes) -> list[int]:
    import llama_cpp

    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        return vocab.tokenize(text, add_bos=True)
    finally:
        vocab.close()  # not at interpreter exit, when llama_cpp's bindings are gone


def long_text() -> bytes:
    """About 700 tokens of varied text: longer than the window, so the local layers drop its start."""
    lines = [f"Shipment {i} left port {i * 7 % 13} on day {i * 3 % 29} carrying {i * 11 % 17} crates of "
             f"{['tea', 'copper', 'wool', 'salt', 'glass'][i % 5]}." for i in range(40)]
    return " ".join(lines).encode() + b" The shipment that carried the most crates was number"


@pytest.fixture(scope="module")
def window(gemma3_path) -> int:
    hp = LayerEngine(gemma3_path, 0, 1, n_ctx=8).hparams()
    assert hp["arch"] == "gemma3" and hp["n_layer"] == N_LAYER
    return hp["n_swa"]


@pytest.mark.parametrize("name", list(PROMPTS))
def test_gemma3_parity_and_greedy(gemma3_path, name):
    prompt = tokenize(gemma3_path, PROMPTS[name])
    ref_logits, ref_tokens = llama_cpp_greedy(gemma3_path, prompt, 16)
    logits, tokens = native_greedy(open_stages(gemma3_path, N_LAYER, 1), prompt, 16)
    assert_parity(logits, ref_logits)
    assert tokens == ref_tokens


def test_gemma3_splits_equal_single(gemma3_path):
    prompt = tokenize(gemma3_path, PROMPTS["capital"])
    logits, tokens = native_greedy(open_stages(gemma3_path, N_LAYER, 1), prompt, 8)
    for n_parts in (2, 3):
        split_logits, split_tokens = native_greedy(open_stages(gemma3_path, N_LAYER, n_parts), prompt, 8)
        np.testing.assert_array_equal(split_logits, logits)
        assert split_tokens == tokens


def test_gemma3_prompt_longer_than_the_window(gemma3_path, window):
    prompt = tokenize(gemma3_path, long_text())
    assert len(prompt) > window + 100
    ref_logits, ref_tokens = llama_cpp_greedy(gemma3_path, prompt, 16, n_ctx=1024, all_rows=False)
    logits, tokens = native_greedy(open_stages(gemma3_path, N_LAYER, 2, n_ctx=1024), prompt, 16, all_rows=False)
    assert_parity(logits, ref_logits)
    assert tokens == ref_tokens


def test_gemma3_kv_cache_keeps_the_window_of_the_local_layers(gemma3_path, window, monkeypatch):
    """docs/models.md's memory figures at --ctx 4096, 1,024 bytes per cell and layer (one KV head of
    256 F16 values each): the full cache (swa_full) holds every layer for all n_ctx cells (75.5 MB);
    by default the 15 local layers hold a window cache of n_swa + 512 = 1,024 cells (28.3 MB)."""
    full = LayerEngine(gemma3_path, 0, N_LAYER, n_ctx=4096, swa_full=True)
    assert window == 512 and len(full.hparams()["swa_layers"]) == 15
    assert full.kv_bytes == N_LAYER * 4096 * 2 * 256 * 2 == 72 << 20 and full.kv_swa_size == 0
    assert LayerEngine(gemma3_path, 0, N_LAYER, n_ctx=4096).kv_swa_size == 0  # below 8 x the window cache: full
    assert LayerEngine(gemma3_path, 0, N_LAYER, n_ctx=8192).kv_swa_size == 1024  # from 8 x: the window cache
    monkeypatch.setenv("PIPEINFER_SWA_FULL", "0")  # the window cache at any size
    eng = LayerEngine(gemma3_path, 0, N_LAYER, n_ctx=4096)
    assert eng.kv_swa_size == 1024
    assert eng.kv_bytes == (3 * 4096 + 15 * 1024) * 2 * 256 * 2 == 27 << 20
