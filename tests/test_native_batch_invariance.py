"""batch_invariant evals give every row bit-identical results to one-token evals.

ggml's CPU matmuls pick kernels by row count (tinyBLAS, repacked gemm, K-quant paths), so a
plain batched eval rounds differently from token-by-token decoding. Lossless speculation needs
the verification batch to reproduce decoding exactly; these tests hold the engine to that.
"""

import numpy as np
import pytest

from pipeinfer_cli.native import LayerEngine
from tinygguf import write_tiny_model

TOKENS = [1, 504, 2988, 314, 42, 216, 33, 30, 198, 17, 3, 9]


def rows(path, chunks, invariant, n_threads=1, begin=0, end=None, vocab=None, tokens=TOKENS):
    """Evaluate tokens in consecutive batches of the given sizes; return every row's logits."""
    eng = LayerEngine(str(path), begin, end if end is not None else LayerEngine(str(path), 0, 1).n_layer,
                      n_ctx=256, n_threads=n_threads)
    toks = np.asarray(tokens, np.int32) % (vocab or eng.n_vocab)
    out, p = [], 0
    for c in chunks:
        out.extend(eng.eval(tokens=toks[p:p + c], pos=np.arange(p, p + c, dtype=np.int32), seq_ids=[[0]] * c,
                            output=np.ones(c, bool), batch_invariant=invariant))
        p += c
    return np.asarray(out)


CHUNKINGS = [[12], [5, 7], [2, 8, 2], [3, 4, 1, 4]]


@pytest.mark.parametrize("chunks", CHUNKINGS)
def test_smollm2_batches_match_single_token_decoding(smollm2_path, chunks):
    single = rows(smollm2_path, [1] * 12, invariant=False)
    assert np.array_equal(rows(smollm2_path, chunks, invariant=True), single)


def test_invariant_flag_leaves_one_token_evals_unchanged(smollm2_path):
    """The reference the invariant batches are held to is plain decoding itself: one-token evals
    with the flag are bit-identical to one-token evals without it."""
    assert np.array_equal(rows(smollm2_path, [1] * 12, invariant=True), rows(smollm2_path, [1] * 12, invariant=False))


def test_invariant_rows_with_some_outputs(smollm2_path):
    """Rows that a verification batch asks logits for (output flags) are the decoded rows, bit for bit,
    whichever other rows the batch drops before the LM head."""
    single = rows(smollm2_path, [1] * 12, invariant=False)
    eng = LayerEngine(str(smollm2_path), 0, 30, n_ctx=256)
    toks = np.asarray(TOKENS, np.int32)
    wanted = np.array([i % 3 != 1 for i in range(12)])
    got, p = [], 0
    for c in (5, 7):
        got.extend(eng.eval(tokens=toks[p:p + c], pos=np.arange(p, p + c, dtype=np.int32), seq_ids=[[0]] * c,
                            output=wanted[p:p + c], batch_invariant=True))
        p += c
    assert np.array_equal(np.asarray(got), single[wanted])


def test_invariant_with_two_threads(smollm2_path):
    single = rows(smollm2_path, [1] * 12, invariant=False, n_threads=2)
    assert np.array_equal(rows(smollm2_path, [5, 7], invariant=True, n_threads=2), single)
    assert np.array_equal(rows(smollm2_path, [5, 7], invariant=True, n_threads=1), single)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_tiny_models_f32_weights(tmp_path, arch):
    """F32 weights go through tinyBLAS from 2 rows: sliced to single rows."""
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch=arch, n_layer=3, n_embd=128, n_head=4, n_head_kv=2, n_ff=256)
    single = rows(path, [1] * 12, invariant=False)
    for chunks in CHUNKINGS:
        assert np.array_equal(rows(path, chunks, invariant=True), single), chunks


@pytest.mark.slow
@pytest.mark.parametrize("which", ["qwen05_path", "qwen15_path"])
def test_qwen_repacked_k_quants(request, which):
    """Q4_K (repacked) and Q6_K weights of the real Qwen files."""
    path = request.getfixturevalue(which)
    single = rows(path, [1] * 12, invariant=False)
    for chunks in CHUNKINGS[:3]:
        assert np.array_equal(rows(path, chunks, invariant=True), single), chunks
