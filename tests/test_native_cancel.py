"""Cancelling an eval: from another thread mid-compute, or before it starts. The engine stops
within a layer (checked with its counters, never with wall-clock time) and frees the cells the
eval claimed, so the cache is as if the eval never happened."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pipeinfer_cli.native import EvalCancelled, LayerEngine
from tinygguf import write_tiny_model

N_LAYER = 16
N_BATCH = 512


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    """Wide enough that one eval of N_BATCH tokens takes many milliseconds per layer."""
    return write_tiny_model(tmp_path_factory.mktemp("cancel") / "wide.gguf", arch="llama", n_layer=N_LAYER,
                            n_embd=256, n_head=8, n_head_kv=4, n_ff=512, weight_type="f16", seed=21)


def batch(n: int, pos0: int = 0) -> dict:
    rng = np.random.default_rng(pos0)
    return dict(tokens=rng.integers(0, 300, n).astype(np.int32), pos=np.arange(pos0, pos0 + n, dtype=np.int32),
                seq_ids=[[0]] * n)


def test_cancel_from_another_thread_mid_compute(slow_model):
    eng = LayerEngine(slow_model, 0, N_LAYER, n_ctx=1024)
    eng.eval(**batch(8))                       # a cached prefix that must survive the cancel
    used_before = eng.kv_used_cells()
    stats_before = eng.stats()

    errors: list[BaseException] = []

    def worker():
        try:
            eng.eval(**batch(N_BATCH, pos0=8))
        except BaseException as e:             # noqa: BLE001 - handed to the main thread
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    # stats()["evals"] counts an eval once it has started (and reset eval_progress() to 0)
    deadline = time.monotonic() + 60
    while (eng.stats()["evals"] == stats_before["evals"] or eng.eval_progress() < 1) and time.monotonic() < deadline:
        time.sleep(0.0005)
    seen = eng.eval_progress()
    eng.cancel()
    t.join(timeout=60)
    assert not t.is_alive()

    assert len(errors) == 1 and isinstance(errors[0], EvalCancelled), errors
    s = eng.stats()
    assert s["evals_cancelled"] - stats_before["evals_cancelled"] == 1
    assert s["cancelled_mid_compute"] - stats_before["cancelled_mid_compute"] == 1
    done = s["layer_evals"] - stats_before["layer_evals"]
    skipped = s["layer_evals_skipped"] - stats_before["layer_evals_skipped"]
    assert done + skipped == N_LAYER
    assert 1 <= seen <= done <= seen + 1      # stopped within the layer that was running
    assert skipped >= 1

    # The claimed cells are free again, and the flag stays set until the caller clears it.
    assert eng.kv_used_cells() == used_before
    assert eng.seq_pos_max(0) == 7
    with pytest.raises(EvalCancelled):
        eng.eval(**batch(1, pos0=8))
    eng.clear_cancel()

    # Evaluating again gives exactly what an engine that was never cancelled gives.
    again = eng.eval(**batch(4, pos0=8), output=None)
    ref = LayerEngine(slow_model, 0, N_LAYER, n_ctx=1024)
    ref.eval(**batch(8))
    np.testing.assert_array_equal(again, ref.eval(**batch(4, pos0=8)))


def test_cancel_before_eval_skips_every_layer(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", n_layer=4)
    stages = [LayerEngine(path, 0, 2, n_ctx=32), LayerEngine(path, 2, 4, n_ctx=32)]
    stages[1].cancel()
    x = stages[0].eval(**batch(3))
    with pytest.raises(EvalCancelled):
        stages[1].eval(embd=x, pos=np.arange(3, dtype=np.int32), seq_ids=[[0]] * 3)
    s = stages[1].stats()
    assert (s["evals_cancelled"], s["cancelled_mid_compute"], s["layer_evals"], s["layer_evals_skipped"]) == (1, 0, 0, 2)
    assert stages[1].kv_used_cells() == 0
    assert stages[1].cancel_requested
    stages[1].clear_cancel()
    logits = stages[1].eval(embd=x, pos=np.arange(3, dtype=np.int32), seq_ids=[[0]] * 3)
    assert logits.shape == (1, stages[1].n_vocab)
    assert stages[1].stats()["layer_evals"] == 2
