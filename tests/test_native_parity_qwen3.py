"""qwen3 files: the native engine computes what llama.cpp computes (tolerance policy of
test_native_parity.py: bit-identical in practice, ATOL 1e-3 allowed, exact argmax and greedy tokens).

Qwen3 is qwen2's layout without the Q/K/V biases, plus an RMS norm of every Q and K head before
RoPE, and heads wider than n_embd / n_head (attention.key_length): the tiny files here have
head_dim 32 with n_embd / n_head = 16, so a head size taken from n_embd would fail.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeinfer_cli.native import LayerEngine
from test_native_batch_invariance import CHUNKINGS, rows
from test_native_parity import (N_DECODE, TINY_PROMPT, assert_parity, assert_split_equals_single, llama_cpp_greedy,
                                native_greedy, open_stages)
from tinygguf import write_tiny_model

HEAD_DIM = 32  # n_embd 64 / n_head 4 = 16: Qwen3-style wide heads


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen3") / "qwen3.gguf", arch="qwen3", n_layer=6,
                            head_dim=HEAD_DIM, seed=3)


def test_qwen3_hparams_from_the_file(qwen3_path):
    hp = LayerEngine(qwen3_path, 0, 1, n_ctx=8).hparams()
    assert hp["arch"] == "qwen3"
    assert hp["n_embd_head"] == HEAD_DIM != hp["n_embd"] // hp["n_head"]
    assert hp["rope_type"] == 2  # NeoX, like qwen2


def test_qwen3_parity_and_greedy(qwen3_path):
    ref_logits, ref_tokens = llama_cpp_greedy(qwen3_path, TINY_PROMPT, N_DECODE)
    logits, tokens = native_greedy(open_stages(qwen3_path, 6, 1), TINY_PROMPT, N_DECODE)
    assert_parity(logits, ref_logits)
    assert tokens == ref_tokens


@pytest.mark.parametrize("n_parts", [2, 3])
def test_qwen3_split_equals_single(qwen3_path, n_parts):
    assert_split_equals_single(qwen3_path, 6, n_parts)


def test_qwen3_quantized_parity(tmp_path):
    """Q4_0 matrices (repacked, as llama.cpp repacks them) with wide heads and tied embeddings."""
    path = write_tiny_model(tmp_path / "q4.gguf", arch="qwen3", n_embd=128, n_head=4, n_head_kv=2, n_ff=256,
                            head_dim=64, weight_type="q4_0", tied_output=True, seed=5)
    ref_logits, ref_tokens = llama_cpp_greedy(path, TINY_PROMPT, 8)
    stages = open_stages(path, 4, 1)
    assert stages[0].n_repacked > 0
    logits, tokens = native_greedy(stages, TINY_PROMPT, 8)
    assert_parity(logits, ref_logits)
    assert tokens == ref_tokens


def test_qwen3_batches_match_single_token_decoding(qwen3_path):
    single = rows(qwen3_path, [1] * 12, invariant=False)
    for chunks in CHUNKINGS:
        assert np.array_equal(rows(qwen3_path, chunks, invariant=True), single), chunks


def test_qwen3_missing_q_norm_is_named(tmp_path):
    from pipeinfer_cli.errors import ModelFileError

    path = write_tiny_model(tmp_path / "noqn.gguf", arch="qwen3", n_layer=2, head_dim=HEAD_DIM,
                            omit_tensors=("blk.1.attn_q_norm.weight",))
    with pytest.raises(ModelFileError, match=r"blk\.1\.attn_q_norm\.weight"):
        LayerEngine(path, 0, 2)
