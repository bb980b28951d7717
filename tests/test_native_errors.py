"""Bad input to the native engine raises a Python exception with a clear message; the process
never aborts (everything is validated before ggml could hit a GGML_ASSERT)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeinfer_cli.errors import ModelFileError
from pipeinfer_cli.native import KVCacheFullError, LayerEngine
from tinygguf import write_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("err") / "ok.gguf", arch="llama", n_layer=4, seed=31)


def one_token(tok: int = 1) -> dict:
    return dict(tokens=np.array([tok], np.int32), pos=np.array([0], np.int32), seq_ids=[[0]])


# --- files ------------------------------------------------------------------------------------
def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        LayerEngine(tmp_path / "nope.gguf", 0, 1)


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_tensor_data(tmp_path, model, keep):
    data = model.read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelFileError, match="truncated"):
        LayerEngine(bad, 0, 4)


def test_truncated_header(tmp_path, model):
    bad = tmp_path / "header.gguf"
    bad.write_bytes(model.read_bytes()[:200])
    with pytest.raises(ModelFileError, match="truncated or corrupted"):
        LayerEngine(bad, 0, 4)


@pytest.mark.parametrize("content", [b"", b"GG", b"GGML" + bytes(100), b"\x00" * 4096])
def test_wrong_magic(tmp_path, content):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(ModelFileError, match="magic"):
        LayerEngine(bad, 0, 1)


def test_missing_tensor_is_named(tmp_path):
    path = write_tiny_model(tmp_path / "missing.gguf", n_layer=4, omit_tensors=("blk.2.ffn_up.weight",))
    with pytest.raises(ModelFileError, match=r"blk\.2\.ffn_up\.weight"):
        LayerEngine(path, 0, 4)
    # a range that does not contain the layer does not need the tensor
    assert LayerEngine(path, 0, 2).layer_end == 2


def test_missing_output_norm_on_last_stage(tmp_path):
    path = write_tiny_model(tmp_path / "no_norm.gguf", n_layer=2, omit_tensors=("output_norm.weight",))
    with pytest.raises(ModelFileError, match="output_norm"):
        LayerEngine(path, 1, 2)
    assert not LayerEngine(path, 0, 1).is_last


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    path = write_tiny_model(tmp_path / "gemma.gguf", arch_name="gemma")
    with pytest.raises(ModelFileError, match=r"'gemma'.*llama, qwen2, qwen3, qwen3moe"):
        LayerEngine(path, 0, 1)


def test_experts_without_expert_used_count_are_refused(tmp_path):
    import gguf

    path = tmp_path / "moe.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_context_length(64)
    w.add_expert_count(8)
    w.add_tensor("token_embd.weight", np.zeros((10, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match=r"llama\.expert_used_count"):
        LayerEngine(path, 0, 1)


# --- construction arguments -------------------------------------------------------------------
@pytest.mark.parametrize("rng", [(0, 5), (-1, 2), (2, 2), (3, 1), (4, 5)])
def test_layer_range_out_of_bounds(model, rng):
    with pytest.raises(ValueError, match=r"layer range .* out of bounds.*4 layers"):
        LayerEngine(model, *rng)


@pytest.mark.parametrize("kw", [dict(n_ctx=0), dict(n_threads=0), dict(n_seq_max=0), dict(n_seq_max=65)])
def test_bad_engine_parameters(model, kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        LayerEngine(model, 0, 4, **kw)


# --- eval inputs ------------------------------------------------------------------------------
@pytest.mark.parametrize("tok", [300, 10**6, -1])
def test_token_id_out_of_range(model, tok):
    eng = LayerEngine(model, 0, 4, n_ctx=16)
    with pytest.raises(ValueError, match=r"token id .* out of range \[0, n_vocab=300\)"):
        eng.eval(**one_token(tok))
    assert eng.kv_used_cells() == 0


def test_float_token_ids_are_refused(model):
    eng = LayerEngine(model, 0, 4, n_ctx=16)
    with pytest.raises(ValueError, match="integers"):
        eng.eval(tokens=np.array([1.5]), pos=np.array([0]), seq_ids=[[0]])


@pytest.mark.parametrize("embd, match", [
    (np.zeros((2, 64), np.float64), "float32"),
    (np.zeros((2, 63), np.float32), r"shape \(n_tokens, 64\)"),
    (np.zeros(64, np.float32), r"shape \(n_tokens, 64\)"),
    ([[0.0] * 64] * 2, "float32"),
])
def test_wrong_hidden_state_shape_or_dtype(model, embd, match):
    eng = LayerEngine(model, 2, 4, n_ctx=16)
    with pytest.raises(ValueError, match=match):
        eng.eval(embd=embd, pos=np.arange(2, dtype=np.int32), seq_ids=[[0]] * 2)
    assert eng.kv_used_cells() == 0


def test_tokens_vs_embd_by_stage(model):
    first, later = LayerEngine(model, 0, 2, n_ctx=16), LayerEngine(model, 2, 4, n_ctx=16)
    with pytest.raises(ValueError, match="tokens="):
        first.eval(embd=np.zeros((1, 64), np.float32), pos=np.array([0], np.int32), seq_ids=[[0]])
    with pytest.raises(ValueError, match="embd="):
        later.eval(**one_token())
    with pytest.raises(ValueError, match="either tokens= or embd="):
        first.eval(tokens=np.array([1], np.int32), embd=np.zeros((1, 64), np.float32),
                   pos=np.array([0], np.int32), seq_ids=[[0]])


@pytest.mark.parametrize("kw, match", [
    (dict(pos=np.array([0, 1], np.int32)), "pos has 2 entries"),
    (dict(pos=np.array([-3], np.int32)), "negative"),
    (dict(seq_ids=[[0], [0]]), "seq_ids has 2 entries"),
    (dict(output=np.array([True, False])), "output has 2 entries"),
])
def test_inconsistent_batch(model, kw, match):
    eng = LayerEngine(model, 0, 4, n_ctx=16)
    with pytest.raises(ValueError, match=match):
        eng.eval(**{**one_token(), **kw})
    assert eng.kv_used_cells() == 0


def test_batch_too_large_for_the_cache(model):
    eng = LayerEngine(model, 0, 4, n_ctx=8)
    n = 9
    with pytest.raises(KVCacheFullError, match="larger than the KV cache"):
        eng.eval(tokens=np.ones(n, np.int32), pos=np.arange(n, dtype=np.int32), seq_ids=[[0]] * n)
    assert isinstance(KVCacheFullError("x"), ValueError)
    assert eng.kv_used_cells() == 0
    eng.eval(tokens=np.ones(8, np.int32), pos=np.arange(8, dtype=np.int32), seq_ids=[[0]] * 8)
    with pytest.raises(KVCacheFullError, match="0 of 8 cells are free"):
        eng.eval(**one_token())
    assert eng.kv_used_cells() == 8
