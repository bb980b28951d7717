"""LayerEngine properties: what a layer range loads, its hyperparameters and counters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeinfer_cli.native import SUPPORTED_ARCHS, LayerEngine
from tinygguf import write_tiny_model


@pytest.fixture(scope="module")
def qwen_file(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("eng") / "q.gguf", arch="qwen2", n_layer=4, n_embd=64,
                            n_head=4, n_head_kv=2, n_ff=128, n_vocab=300, rope_freq_base=1e6, seed=41)


def test_properties_of_ranges(qwen_file):
    first, mid, last = (LayerEngine(qwen_file, b, e, n_ctx=32, n_seq_max=4) for b, e in ((0, 1), (1, 3), (3, 4)))
    assert [s.arch for s in (first, mid, last)] == ["qwen2"] * 3
    assert first.arch in SUPPORTED_ARCHS
    assert (first.n_layer, first.n_embd, first.n_vocab, first.n_ctx, first.n_seq_max) == (4, 64, 300, 32, 4)
    assert (first.is_first, first.is_last) == (True, False)
    assert (mid.is_first, mid.is_last) == (False, False)
    assert (last.is_first, last.is_last) == (False, True)
    assert (mid.layer_begin, mid.layer_end) == (1, 3)
    hp = first.hparams()
    assert (hp["n_head"], hp["n_head_kv"], hp["n_ff"], hp["rope_freq_base"]) == (4, 2, 128, 1e6)
    assert hp["rope_type"] == 2  # NeoX for qwen2
    assert "qwen2" in repr(mid) and "1, 3" in repr(mid)
    assert first.stats() == dict(evals=0, evals_cancelled=0, cancelled_mid_compute=0, layer_evals=0,
                                 layer_evals_skipped=0, t_compute_us=0)


def test_weight_bytes_count_only_the_range(qwen_file):
    f32 = 4
    n_embd, n_ff, n_kv, n_vocab = 64, 128, 32, 300
    per_layer = f32 * (2 * n_embd + n_embd * n_embd * 2 + n_embd * n_kv * 2 + n_embd + 2 * n_kv + 3 * n_embd * n_ff)
    embd = f32 * n_embd * n_vocab
    assert LayerEngine(qwen_file, 1, 3, n_ctx=8).weight_bytes == 2 * per_layer
    assert LayerEngine(qwen_file, 0, 1, n_ctx=8).weight_bytes == per_layer + embd
    assert LayerEngine(qwen_file, 3, 4, n_ctx=8).weight_bytes == per_layer + f32 * n_embd + embd
    whole = LayerEngine(qwen_file, 0, 4, n_ctx=8)
    assert whole.weight_bytes == 4 * per_layer + 2 * embd + f32 * n_embd
    # KV: K and V, F16, n_embd_gqa per cell, for the layers of the range only
    assert LayerEngine(qwen_file, 1, 3, n_ctx=8).kv_bytes >= 2 * 2 * 8 * n_kv * 2


def test_repack_off_gives_the_same_tokens(tmp_path):
    path = write_tiny_model(tmp_path / "q4.gguf", n_embd=128, n_ff=256, weight_type="q4_0", seed=42)
    on, off = LayerEngine(path, 0, 4, n_ctx=64), LayerEngine(path, 0, 4, n_ctx=64, use_repack=False)
    assert on.n_repacked > 0 and off.n_repacked == 0
    toks = np.array([3, 1, 4, 1, 5, 9, 2, 6], np.int32)
    kw = dict(pos=np.arange(8, dtype=np.int32), seq_ids=[[0]] * 8, output=np.ones(8, bool))
    a, b = on.eval(tokens=toks, **kw), off.eval(tokens=toks, **kw)
    # different kernels (q4_0_8x8 gemm vs vec_dot) round differently, but barely
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-3)
    assert (a.argmax(1) == b.argmax(1)).all()


def test_stats_count_layers(qwen_file):
    eng = LayerEngine(qwen_file, 1, 3, n_ctx=32)
    for i in range(3):
        eng.eval(embd=np.zeros((2, 64), np.float32), pos=np.array([2 * i, 2 * i + 1], np.int32), seq_ids=[[0], [0]])
    s = eng.stats()
    assert (s["evals"], s["layer_evals"], s["layer_evals_skipped"], s["evals_cancelled"]) == (3, 6, 0, 0)
    assert s["t_compute_us"] > 0
    assert eng.eval_progress() == 2


@pytest.mark.parametrize("split", [None, 2, 3])  # 3: the last stage holds one layer
def test_batch_without_output_rows_fills_the_cache(tiny_qwen2, split):
    """A prompt chunk before the last asks the last stage for no rows: it returns (0, n_vocab),
    stores its K/V, and the next chunk's logits are bit-identical to a run that asked for a row."""
    from pipeinfer_cli.native import LayerEngine

    def run(first_output: bool) -> np.ndarray:
        stages = ([LayerEngine(str(tiny_qwen2), 0, 4, n_ctx=64)] if split is None else
                  [LayerEngine(str(tiny_qwen2), 0, split, n_ctx=64), LayerEngine(str(tiny_qwen2), split, 4, n_ctx=64)])
        out = None
        for b, want_row in ((0, first_output), (5, True)):
            toks = np.arange(3 + b, 8 + b, dtype=np.int32)
            x = None
            for i, eng in enumerate(stages):
                kw = dict(tokens=toks) if i == 0 else dict(embd=x)
                x = eng.eval(**kw, pos=np.arange(b, b + 5, dtype=np.int32), seq_ids=[[0]] * 5,
                             output=[False] * 4 + [want_row])
            if b == 0 and not first_output:
                assert x.shape == (0, stages[-1].n_vocab)
                assert stages[-1].kv_used_cells() == 5
            out = x
        return out

    assert np.array_equal(run(False), run(True))


THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_LOAD_AND_COUNT = """
import sys
from pipeinfer_cli.native import LayerEngine
engine = LayerEngine(sys.argv[1], 0, int(sys.argv[2]), n_ctx=2048)
huge = next(int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages:"))
print(huge * 1024, engine.weight_bytes + engine.kv_bytes)
"""


def _huge_bytes_after_loading(path: Path, n_layer: int, **env: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", _LOAD_AND_COUNT, str(path), str(n_layer)], check=True,
                         capture_output=True, text=True, env={**os.environ, **env}).stdout.split()
    return int(out[0]), int(out[1])


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
                    reason="this kernel gives no transparent huge pages")
def test_weights_and_kv_cache_sit_on_huge_pages(smollm2_path):
    # Under THP "madvise" (the common default) large buffers get 4 KiB pages unless advised; the
    # engine advises its weight and KV buffers, and PIPEINFER_HUGEPAGES=0 turns that off.
    huge, engine_bytes = _huge_bytes_after_loading(smollm2_path, 30)
    assert huge >= engine_bytes // 2, (huge, engine_bytes)
    if "[madvise]" in THP_MODE.read_text():
        off, _ = _huge_bytes_after_loading(smollm2_path, 30, PIPEINFER_HUGEPAGES="0")
        assert off < engine_bytes // 10, (off, engine_bytes)
