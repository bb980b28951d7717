"""KV cache semantics of the native engine: llama.cpp's seq_rm/seq_cp/seq_keep with [p0, p1)
ranges, and attention that sees exactly the cells sharing a sequence at positions <= the token's.

References are fresh engines fed the same batches (matmul kernels depend on the batch size, and
K/V are rounded to F16, so a different batching changes the last bits). Results whose cells sit
at other cache indices (shared prefixes, trees) differ from the reference only by summation order
and are compared with TOL: a last-bit difference in one layer can flip the F16 rounding of a K/V
element in the next, which shows up as ~1e-4 in the logits (measured max 1.7e-4). Runs that reuse
the same cells are compared bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from pipeinfer_cli.native import KVCacheFullError, LayerEngine
from tinygguf import write_tiny_model

TOL = 1e-3


class KvModel(NamedTuple):
    path: Path
    flash_attn: bool  # both attention paths must implement the same cell semantics


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("kv") / "kv.gguf", arch="qwen2", n_layer=3, seed=11)


@pytest.fixture(params=[False, True], ids=["softmax", "flash_attn"])
def model(model_file, request) -> KvModel:
    return KvModel(model_file, request.param)


def open_engine(model: KvModel, **kw) -> LayerEngine:
    kw.setdefault("n_ctx", 64)
    kw.setdefault("n_seq_max", 8)
    return LayerEngine(model.path, 0, 3, flash_attn=model.flash_attn, **kw)


def run(eng: LayerEngine, tokens, pos0: int, seqs, all_rows: bool = False) -> np.ndarray:
    """Eval tokens at consecutive positions; every token in the sequence set `seqs`."""
    n = len(tokens)
    return eng.eval(tokens=np.array(tokens, np.int32), pos=np.arange(pos0, pos0 + n, dtype=np.int32),
                    seq_ids=[list(seqs)] * n, output=np.ones(n, bool) if all_rows else None)


PREFIX = [10, 20, 30, 40, 50]
A = [60, 70, 80]
B = [90, 100, 110]


def fresh(model, *batches) -> np.ndarray:
    """Logits (all rows) of the last batch, after feeding the batches to a fresh engine in seq 0."""
    eng, pos = open_engine(model), 0
    for tokens in batches:
        out = run(eng, tokens, pos, [0], all_rows=True)
        pos += len(tokens)
    return out


def test_shared_prefix_via_seq_cp_equals_separate_runs(model):
    eng = open_engine(model)
    run(eng, PREFIX, 0, [0])
    eng.seq_cp(0, 1)
    assert eng.kv_used_cells() == len(PREFIX)  # seq_cp shares cells, it does not copy them
    out_a = run(eng, A, len(PREFIX), [0], all_rows=True)
    out_b = run(eng, B, len(PREFIX), [1], all_rows=True)
    np.testing.assert_array_equal(out_a, fresh(model, PREFIX, A))  # same cells as the reference
    np.testing.assert_allclose(out_b, fresh(model, PREFIX, B), rtol=0, atol=TOL)
    assert eng.seq_pos_max(0) == eng.seq_pos_max(1) == len(PREFIX) + 2
    assert eng.seq_pos_min(1) == 0


def test_seq_cp_many_equals_repeated_seq_cp(model):
    eng = open_engine(model)
    run(eng, PREFIX, 0, [0])
    eng.seq_cp_many(0, [1, 2, 3], 0, 3)
    for s in (1, 2, 3):
        assert (eng.seq_pos_min(s), eng.seq_pos_max(s)) == (0, 2)
    out = run(eng, B, 3, [2], all_rows=True)
    np.testing.assert_allclose(out, fresh(model, PREFIX[:3], B), rtol=0, atol=TOL)


def test_seq_rm_of_rejected_suffix_equals_never_evaluated(model):
    eng = open_engine(model)
    run(eng, PREFIX, 0, [0])
    run(eng, A, len(PREFIX), [0])              # a draft that gets rejected
    eng.seq_rm(0, len(PREFIX), -1)
    assert eng.seq_pos_max(0) == len(PREFIX) - 1
    assert eng.kv_used_cells() == len(PREFIX)
    out = run(eng, B, len(PREFIX), [0], all_rows=True)
    # the freed cells are reused in the same order, so this is bit-identical
    np.testing.assert_array_equal(out, fresh(model, PREFIX, B))


def test_token_in_two_sequences_sees_both_prefixes(model):
    """A tree: seq 0 = PREFIX, seq 1 = A at the same positions 0..2; a token in both sequences
    attends to the cells of both branches."""
    tree = open_engine(model)
    run(tree, PREFIX[:3], 0, [0])
    run(tree, A, 0, [1])
    both = run(tree, [7], 3, [0, 1])
    assert tree.seq_pos_max(0) == tree.seq_pos_max(1) == 3

    # Same cells, expressed differently: put both branches in seq 0 with seq_cp, then eval in seq 0.
    ref = open_engine(model)
    run(ref, PREFIX[:3], 0, [0])
    run(ref, A, 0, [1])
    ref.seq_cp(1, 0)
    np.testing.assert_array_equal(both, run(ref, [7], 3, [0]))

    # And it is not what either branch alone gives.
    only0 = fresh(model, PREFIX[:3], [7])
    only1 = fresh(model, A, [7])
    assert np.abs(both - only0).max() > 1e-3
    assert np.abs(both - only1).max() > 1e-3


def test_tokens_of_one_batch_attend_causally_by_position(model):
    """Within one batch a token sees only the batch rows at positions <= its own: a batch gives
    what token-by-token evaluation gives (up to batch-size rounding effects)."""
    one = fresh(model, PREFIX + A)
    eng = open_engine(model)
    rows = [run(eng, [t], i, [0]) for i, t in enumerate(PREFIX + A)]
    np.testing.assert_allclose(np.concatenate(rows), one, rtol=0, atol=TOL)
    assert (np.concatenate(rows).argmax(1) == one.argmax(1)).all()


def test_seq_keep_and_seq_rm_all(model):
    eng = open_engine(model)
    run(eng, PREFIX, 0, [0])
    eng.seq_cp(0, 1, 0, 2)
    run(eng, B, 5, [1])
    run(eng, A, 5, [2])
    assert eng.kv_used_cells() == 11
    eng.seq_keep(1)
    assert eng.seq_pos_max(0) == -1 and eng.seq_pos_max(2) == -1
    assert (eng.seq_pos_min(1), eng.seq_pos_max(1)) == (0, 7)
    assert eng.kv_used_cells() == 5         # positions 0, 1 and the three tokens of B
    eng.seq_rm(-1, 6, -1)                    # every sequence, positions >= 6
    assert eng.seq_pos_max(1) == 5
    eng.seq_rm(1, -1, 1)                     # open start: positions < 1
    assert eng.seq_pos_min(1) == 1
    eng.kv_clear()
    assert eng.kv_used_cells() == 0 and eng.seq_pos_max(1) == -1


def test_batch_that_does_not_fit_leaves_cache_unchanged(model):
    eng = open_engine(model, n_ctx=8)
    run(eng, PREFIX, 0, [0])
    with pytest.raises(KVCacheFullError, match="free"):
        run(eng, A + B, 5, [0])
    assert eng.kv_used_cells() == 5 and eng.seq_pos_max(0) == 4
    out = run(eng, A, 5, [0], all_rows=True)   # still fits exactly
    np.testing.assert_array_equal(out, run(open_engine(model, n_ctx=8), PREFIX + A, 0, [0], all_rows=True)[5:])


def test_bad_sequence_ids_are_refused(model):
    eng = open_engine(model, n_seq_max=4)
    with pytest.raises(ValueError, match="n_seq_max"):
        run(eng, [1], 0, [4])
    with pytest.raises(ValueError, match="empty"):
        eng.eval(tokens=np.array([1], np.int32), pos=np.array([0], np.int32), seq_ids=[[]])
    with pytest.raises(ValueError, match="out of range"):
        eng.seq_cp(0, 9)
    with pytest.raises(ValueError, match="out of range"):
        eng.seq_pos_max(-2)
    assert eng.kv_used_cells() == 0


def test_stage_engines_keep_the_same_cells(model):
    """Every stage sees the same batches and KV ops, so their caches stay in step."""
    stages = [LayerEngine(model.path, b, e, n_ctx=64, n_seq_max=8, flash_attn=model.flash_attn)
              for b, e in ((0, 1), (1, 3))]
    x = stages[0].eval(tokens=np.array(PREFIX, np.int32), pos=np.arange(5, dtype=np.int32), seq_ids=[[0]] * 5)
    assert x.shape == (5, stages[0].n_embd) and x.dtype == np.float32
    stages[1].eval(embd=x, pos=np.arange(5, dtype=np.int32), seq_ids=[[0]] * 5)
    for st in stages:
        st.seq_cp(0, 3, 0, 2)
        assert st.kv_used_cells() == 5 and st.seq_pos_max(3) == 1


def test_seq_ids_accept_bare_ints_and_numpy_rows(model):
    a = run(open_engine(model), PREFIX, 0, [0], all_rows=True)
    eng = open_engine(model)
    b = eng.eval(tokens=np.array(PREFIX, np.int32), pos=np.arange(5, dtype=np.int32),
                 seq_ids=[0, np.int64(0), np.array([0]), (0,), [0]], output=np.ones(5, bool))
    np.testing.assert_array_equal(a, b)
