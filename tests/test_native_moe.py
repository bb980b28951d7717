"""Mixture-of-experts files (qwen3moe, llama with experts): the native engine computes what
llama.cpp computes, every stage holds only its own layers' experts, and batch-invariant evals give
every row the logits plain decoding gives it.

Tolerance policy of test_native_parity.py: the logits are bit-identical in practice, ATOL 1e-3 is
allowed, argmax and greedy tokens must be exactly equal. (Leaving out the renormalisation of the
top-k router weights moves the logits of these files by 0.02-0.2, well outside it.)
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from pipeinfer_cli.errors import ModelFileError
from pipeinfer_cli.models.gguf_info import read_model_info
from pipeinfer_cli.native import LayerEngine
from test_native_batch_invariance import CHUNKINGS, rows
from test_native_parity import (N_DECODE, TINY_PROMPT, assert_parity, assert_split_equals_single, llama_cpp_greedy,
                                native_greedy, open_stages, split_ranges)
from tinygguf import write_tiny_model

# name -> write_tiny_model arguments. qwen3moe: 8 experts, 2 used, experts narrower than n_ff and
# Qwen3's wide heads; llama: Mixtral-style, 4 experts of n_ff, 2 used.
MOE_FILES = {
    "qwen3moe": dict(arch="qwen3moe", n_layer=6, n_expert=8, n_expert_used=2, n_ff_exp=32, head_dim=32, seed=3),
    "llama-moe": dict(arch="llama", n_layer=6, n_expert=4, n_expert_used=2, seed=4),
}


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory, request):
    return write_tiny_model(tmp_path_factory.mktemp("moe") / f"{request.param}.gguf", **MOE_FILES[request.param])


moe_files = pytest.mark.parametrize("moe_path", list(MOE_FILES), indirect=True)


@moe_files
def test_moe_hparams_from_the_file(moe_path):
    hp = LayerEngine(moe_path, 0, 1, n_ctx=8).hparams()
    kw = MOE_FILES[moe_path.stem]
    assert (hp["n_expert"], hp["n_expert_used"]) == (kw["n_expert"], kw["n_expert_used"])
    assert hp["n_ff_exp"] == kw.get("n_ff_exp", hp["n_ff"])


@moe_files
def test_moe_parity_and_greedy(moe_path):
    ref_logits, ref_tokens = llama_cpp_greedy(moe_path, TINY_PROMPT, N_DECODE)
    logits, tokens = native_greedy(open_stages(moe_path, 6, 1), TINY_PROMPT, N_DECODE)
    assert_parity(logits, ref_logits)
    assert tokens == ref_tokens


@moe_files
@pytest.mark.parametrize("n_parts", [2, 3])
def test_moe_split_equals_single(moe_path, n_parts):
    assert_split_equals_single(moe_path, 6, n_parts)


def test_llama_moe_without_gate_experts(tmp_path):
    """llama.cpp loads a llama MoE without ffn_gate_exps and computes SiLU(up); so does the engine."""
    path = write_tiny_model(tmp_path / "nogate.gguf", arch="llama", n_layer=2, n_expert=4, n_expert_used=2, seed=8,
                            omit_tensors=tuple(f"blk.{i}.ffn_gate_exps.weight" for i in range(2)))
    ref_logits, ref_tokens = llama_cpp_greedy(path, TINY_PROMPT, 8)
    logits, tokens = native_greedy(open_stages(path, 2, 1), TINY_PROMPT, 8)
    assert_parity(logits, ref_logits)
    assert tokens == ref_tokens


def test_moe_one_expert_used(tmp_path):
    path = write_tiny_model(tmp_path / "top1.gguf", arch="qwen3moe", n_layer=2, n_expert=4, n_expert_used=1,
                            n_ff_exp=64, seed=9)
    ref_logits, _ = llama_cpp_greedy(path, TINY_PROMPT, 0)
    assert_parity(native_greedy(open_stages(path, 2, 1), TINY_PROMPT, 0)[0], ref_logits)


@pytest.mark.parametrize("weight_type", ["q8_0", "q4_0"])
def test_moe_quantized_parity(tmp_path, weight_type):
    """Quantized experts; Q4_0 experts go to CPU_REPACK (MUL_MAT_ID), as llama.cpp places them."""
    path = write_tiny_model(tmp_path / f"{weight_type}.gguf", arch="qwen3moe", n_layer=2, n_expert=4,
                            n_expert_used=2, n_ff_exp=64, weight_type=weight_type, seed=10)
    ref_logits, ref_tokens = llama_cpp_greedy(path, TINY_PROMPT, 8)
    stages = open_stages(path, 2, 1)
    if weight_type == "q4_0":
        assert stages[0].n_repacked >= 2 * 7  # the 4 attention matrices and the 3 expert stacks per layer
    logits, tokens = native_greedy(stages, TINY_PROMPT, 8)
    assert_parity(logits, ref_logits)
    assert tokens == ref_tokens


# -- K-quants (llama.cpp's own quantizer) -------------------------------------------------------

@pytest.fixture(scope="module")
def q4_k_m_moe(tmp_path_factory):
    """A qwen3moe file quantized by llama.cpp to Q4_K_M: Q4_K experts (repacked, one gemv per row in
    MUL_MAT_ID) and Q6_K down experts in layer 1 (not repacked on x86: ggml's tiled K-quant kernel
    takes an expert's rows from 8 on)."""
    import llama_cpp

    from pipeinfer_cli import _native

    d = tmp_path_factory.mktemp("kquant")
    src = write_tiny_model(d / "f32.gguf", arch="qwen3moe", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                           n_expert=4, n_expert_used=2, n_ff_exp=256, head_dim=64, seed=7)
    dst = d / "q4_k_m.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 1
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0
    types = {name: t for name, t, _, _ in _native.gguf_metadata(str(dst))["tensors"]}
    assert types["blk.0.ffn_up_exps.weight"] == "Q4_K" and types["blk.1.ffn_down_exps.weight"] == "Q6_K"
    return dst


def test_k_quant_moe_parity(q4_k_m_moe):
    ref_logits, ref_tokens = llama_cpp_greedy(q4_k_m_moe, TINY_PROMPT, 8)
    logits, tokens = native_greedy(open_stages(q4_k_m_moe, 2, 1), TINY_PROMPT, 8)
    assert_parity(logits, ref_logits)
    assert tokens == ref_tokens


# -- batch invariance ---------------------------------------------------------------------------

BATCH_TOKENS = [1, 504, 2988, 314, 42, 216, 33, 30, 198, 17, 3, 9, 77, 140, 260, 5]


def all_rows(path, chunks, invariant):
    return rows(path, chunks, invariant, tokens=BATCH_TOKENS)


@moe_files
def test_moe_batches_match_single_token_decoding(moe_path):
    single = all_rows(moe_path, [1] * 16, invariant=False)
    for chunks in [[16], *[c + [4] for c in CHUNKINGS]]:
        assert np.array_equal(all_rows(moe_path, chunks, invariant=True), single), chunks


def test_k_quant_moe_batches_match_single_token_decoding(q4_k_m_moe):
    """16 rows, 2 experts each, over 4 experts: some expert gets at least 8 rows of one batch, where
    ggml's tiled kernel would take over the Q6_K experts; the invariant graph keeps every expert's
    rows on the one-row kernels, so each row equals its one-token decode."""
    single = all_rows(q4_k_m_moe, [1] * 16, invariant=False)
    for chunks in ([16], [9, 7], [3, 13]):
        assert np.array_equal(all_rows(q4_k_m_moe, chunks, invariant=True), single), chunks


# -- memory: a stage holds its own layers' experts only -------------------------------------------

@pytest.mark.parametrize("moe_path", ["qwen3moe"], indirect=True)
@pytest.mark.parametrize("n_parts", [1, 2, 3])
def test_stage_loads_only_its_layers_experts(moe_path, n_parts):
    info = read_model_info(moe_path)
    assert sum(info.expert_bytes) > 0
    for b, e in split_ranges(6, n_parts):
        st = LayerEngine(moe_path, b, e, n_ctx=16)
        assert st.expert_bytes == sum(info.expert_bytes[b:e])
        ends = (info.token_embd_bytes if b == 0 else 0) + (info.output_bytes + info.other_bytes if e == 6 else 0)
        assert st.weight_bytes == sum(info.layer_bytes[b:e]) + ends


# -- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("missing", ["blk.1.ffn_down_exps.weight", "blk.2.ffn_gate_inp.weight",
                                     "blk.0.ffn_gate_exps.weight"])
def test_missing_expert_tensor_is_named(tmp_path, missing):
    path = write_tiny_model(tmp_path / "missing.gguf", **{**MOE_FILES["qwen3moe"], "n_layer": 3},
                            omit_tensors=(missing,))
    with pytest.raises(ModelFileError, match=missing.replace(".", r"\.")):
        LayerEngine(path, 0, 3)


def test_expert_count_must_cover_the_experts_used(tmp_path):
    path = write_tiny_model(tmp_path / "bad.gguf", arch="qwen3moe", n_layer=1, n_expert=2, n_expert_used=3)
    with pytest.raises(ModelFileError, match="expert_used_count"):
        LayerEngine(path, 0, 1)
