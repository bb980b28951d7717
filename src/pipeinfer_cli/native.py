"""Typed wrapper of the native layer engine (`pipeinfer_cli._native`, C++ on ggml).

A `LayerEngine` holds the layers `[layer_begin, layer_end)` of a GGUF file (an architecture of
`SUPPORTED_ARCHS`), its own multi-sequence KV cache, and computes one pipeline stage:

    eng = LayerEngine(path, 0, 12, n_ctx=4096, n_threads=2)
    hidden = eng.eval(tokens=np.array([1, 2, 3], np.int32), pos=np.arange(3, dtype=np.int32),
                      seq_ids=[[0], [0], [0]])          # (3, n_embd) float32 for the next stage

The last stage returns logits `(n_out, n_vocab)` for the rows whose `output` flag is set.

Errors:
- `pipeinfer_cli.errors.ModelFileError`: missing, truncated or non-GGUF file, missing tensor,
  unsupported architecture.
- `ValueError`: bad arguments (layer range, token ids, shapes, dtypes, sequence ids). Every check
  is done once, in C++ (`native/src/engine.h` documents them); this module only turns array-likes
  into arrays of the right dtype.
- `KVCacheFullError` (a `ValueError`): the batch does not fit in the free KV cells; the cache is
  unchanged.
- `EvalCancelled` (a `RuntimeError`): `cancel()` was called; the cells the eval claimed are freed,
  so the cache is as it was before the call.
"""

from __future__ import annotations

import operator
import os
import time
from collections.abc import Sequence
from typing import Any, TypedDict

import numpy as np

from . import _native
from .errors import GgmlCpuError, ModelFileError

__all__ = ["LayerEngine", "EvalCancelled", "KVCacheFullError", "SUPPORTED_ARCHS", "ggml_cpu"]

SUPPORTED_ARCHS: tuple[str, ...] = _native.supported_archs()
"""Architectures (`general.architecture`) the engine computes; the list lives in model_loader.cpp."""

EvalCancelled = _native.EvalCancelled
"""Raised by `LayerEngine.eval` when the cancel flag was set before or during the eval."""

KVCacheFullError = _native.KVCacheFullError
"""Raised when a batch needs more free KV cells than the cache has (a `ValueError`)."""


def ggml_cpu() -> dict[str, Any]:
    """ggml's CPU backend in this process: `variant` ("zen4", "haswell", ...; "builtin" for a ggml
    built with one CPU backend inside), `library`, `dynamic`, `forced` (PIPEINFER_GGML_CPU or None),
    `available` (the variants installed) and `features` (ggml_backend_get_features).

    The first call loads it when ggml has none yet: a ggml built with a library per CPU variant
    (`make install GGML_CPU=all`) registers none until asked, and llama.cpp loads none itself, so
    this runs before llama_cpp loads a model. The variant is the one whose score is best on this
    CPU, or the one PIPEINFER_GGML_CPU names. Raises GgmlCpuError when that cannot be loaded."""
    try:
        return _native.cpu_backend()
    except (ValueError, RuntimeError) as e:
        raise GgmlCpuError(str(e)) from None


class HParams(TypedDict):
    """A model's hyperparameters as the engine read them from the file (`LayerEngine.hparams`)."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_embd_head: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    f_norm_rms_eps: float
    rope_type: int
    rope_freq_base: float
    rope_freq_scale: float
    n_expert: int
    n_expert_used: int
    n_ff_exp: int  # 0 for a dense model
    n_swa: int
    swa_layers: list[int]


class EngineStats(TypedDict):
    """An engine's counters since it was opened (`LayerEngine.stats`)."""

    evals: int
    evals_cancelled: int
    cancelled_mid_compute: int
    layer_evals: int
    layer_evals_skipped: int
    t_compute_us: int


class LayerEngine:
    """One pipeline stage: the layers `[layer_begin, layer_end)` of a GGUF model plus a KV cache.

    Args:
        path: GGUF file (an architecture of `SUPPORTED_ARCHS`).
        layer_begin, layer_end: the layer range; `0 <= layer_begin < layer_end <= n_layer`.
            The first stage (layer_begin == 0) also loads the token embeddings, the last stage
            (layer_end == n_layer) the output norm and LM head.
        n_ctx: KV cache cells (tokens, summed over all sequences, that can be cached).
        n_threads: ggml compute threads.
        n_seq_max: sequence ids are in `[0, n_seq_max)`, at most 64.
        use_repack: put quantized matrices in ggml's CPU_REPACK buffers (as llama.cpp does);
            turning it off is only useful to measure its effect.
        flash_attn: attention with ggml_flash_attn_ext (F16 mask, V not transposed) instead of
            mul_mat + soft_max. Off by default because llama.cpp's default is off, and the
            logits match llama.cpp bit for bit only when both use the same path.
        swa_full: sliding-window layers (Gemma 3's local layers) keep every cell, as llama.cpp's
            --swa-full (also PIPEINFER_SWA_FULL=1). By default they keep a cache of their window
            plus 512 cells, whose attention is bit-identical to the full cache's.
        slowdown: every eval takes this many times as long (it sleeps the difference after
            computing): a slower node emulated for tests and benchmarks (PIPEINFER_DEBUG_SLOW).
    """

    def __init__(self, path: str | os.PathLike[str], layer_begin: int, layer_end: int, *, n_ctx: int = 4096,
                 n_threads: int = 1, n_seq_max: int = 64, use_repack: bool = True,
                 flash_attn: bool = False, swa_full: bool = False, n_slots: int = 1, slowdown: float = 1.0) -> None:
        path = os.fspath(path)
        index = operator.index  # integers (numpy ones too), never a truncated float
        ggml_cpu()
        try:
            self._eng = _native.LayerEngine(path, index(layer_begin), index(layer_end), n_ctx=index(n_ctx),
                                            n_threads=index(n_threads), n_seq_max=index(n_seq_max),
                                            use_repack=bool(use_repack), flash_attn=bool(flash_attn),
                                            swa_full=bool(swa_full), n_slots=index(n_slots))
        except _native.ModelFileError as e:
            raise ModelFileError(str(e)) from None
        self.path = path
        self.slowdown = float(slowdown)

    # --- read-only properties -------------------------------------------------------------
    @property
    def arch(self) -> str:
        """`general.architecture` of the file, one of `SUPPORTED_ARCHS`."""
        return self._eng.arch

    @property
    def n_layer(self) -> int:
        """Layers in the whole model file."""
        return self._eng.n_layer

    @property
    def layer_begin(self) -> int:
        return self._eng.layer_begin

    @property
    def layer_end(self) -> int:
        return self._eng.layer_end

    @property
    def n_embd(self) -> int:
        return self._eng.n_embd

    @property
    def n_vocab(self) -> int:
        return self._eng.n_vocab

    @property
    def n_ctx(self) -> int:
        return self._eng.n_ctx

    @property
    def n_seq_max(self) -> int:
        return self._eng.n_seq_max

    @property
    def n_slots(self) -> int:
        return self._eng.n_slots

    @property
    def n_threads(self) -> int:
        return self._eng.n_threads

    @property
    def flash_attn(self) -> bool:
        """Whether attention uses ggml_flash_attn_ext."""
        return self._eng.flash_attn

    @property
    def is_first(self) -> bool:
        """True when the range starts at layer 0 (eval takes token ids)."""
        return self._eng.is_first

    @property
    def is_last(self) -> bool:
        """True when the range ends at the last layer (eval returns logits)."""
        return self._eng.is_last

    @property
    def weight_bytes(self) -> int:
        """Bytes of the tensors this range loaded (a tied LM head counts as a second copy)."""
        return self._eng.weight_bytes

    @property
    def expert_bytes(self) -> int:
        """Of `weight_bytes`, the mixture-of-experts matrices (`ffn_*_exps`) of this range; 0 if dense."""
        return self._eng.expert_bytes

    @property
    def kv_bytes(self) -> int:
        """Bytes of this stage's K and V cache tensors (the full cache and the window cache)."""
        return self._eng.kv_bytes

    @property
    def kv_swa_size(self) -> int:
        """Cells of the sliding-window layers' own cache; 0 when they keep every cell (no such
        layers, `swa_full`, PIPEINFER_SWA_FULL=1, or an n_ctx no larger than the window cache)."""
        return self._eng.kv_swa_size

    @property
    def n_repacked(self) -> int:
        """Weight matrices placed in a CPU extra buffer type (CPU_REPACK)."""
        return self._eng.n_repacked

    def hparams(self) -> HParams:
        """Hyperparameters read from the file (n_head, n_head_kv, n_ff, rope settings, n_expert,
        n_expert_used, n_ff_exp (0 for a dense model), ...)."""
        return self._eng.hparams()

    # --- compute --------------------------------------------------------------------------
    def eval(self, tokens: np.ndarray | Sequence[int] | None = None, embd: np.ndarray | None = None, *,
             pos: np.ndarray | Sequence[int], seq_ids: Sequence[Sequence[int]],
             output: np.ndarray | Sequence[bool] | None = None, batch_invariant: bool = False) -> np.ndarray:
        """Run one batch through the stage's layers and store its K/V in the cache.

        Args:
            tokens: int32 `(n,)` token ids; first stage only.
            embd: float32 `(n, n_embd)` hidden states from the previous stage; other stages.
            pos: int32 `(n,)` position of each token.
            seq_ids: `n` non-empty lists of sequence ids; a token attends to cached cells that
                share one of its sequences and sit at a position <= its own.
            output: bool `(n,)`, rows whose logits the last stage returns (None: last row only).
                Ignored by the other stages, which return every row.
            batch_invariant: compute every row bit for bit as a one-token batch would. ggml's CPU
                matmul kernels change with the row count, so without it a token verified in a
                batch can get slightly different logits than when decoded alone. Speculative
                verification sets it; prompt processing does not need it.

        Returns:
            float32 `(n, n_embd)` hidden states, or `(n_out, n_vocab)` logits on the last stage.

        Raises:
            EvalCancelled: `cancel()` was called; the cache is unchanged.
            KVCacheFullError: not enough free cells; the cache is unchanged.
            ValueError: malformed inputs.
        """
        if tokens is not None:
            tokens = _as_int32(tokens, "tokens")
        if embd is not None:
            # Hidden states travel as float32; another dtype is a caller's mistake, not converted.
            if not isinstance(embd, np.ndarray) or embd.dtype != np.float32:
                got = embd.dtype if isinstance(embd, np.ndarray) else type(embd).__name__
                raise ValueError(f"embd must be a float32 numpy array of shape (n_tokens, {self.n_embd}), got {got}")
            embd = np.ascontiguousarray(embd)
        pos = _as_int32(pos, "pos")
        if output is not None:
            output = np.ascontiguousarray(output, dtype=np.bool_)
        if self.slowdown == 1.0:
            return self._eng.eval(tokens=tokens, embd=embd, pos=pos, seq_ids=seq_ids, output=output,
                                  batch_invariant=bool(batch_invariant))
        t0 = time.perf_counter()
        out = self._eng.eval(tokens=tokens, embd=embd, pos=pos, seq_ids=seq_ids, output=output,
                             batch_invariant=bool(batch_invariant))
        time.sleep((self.slowdown - 1.0) * (time.perf_counter() - t0))
        return out

    def cancel(self) -> None:
        """Make the running (or next) eval stop as soon as possible. Thread-safe.

        The flag stays set until `clear_cancel()`: eval does not reset it, so a listener thread
        cannot race with the caller."""
        self._eng.cancel()

    def clear_cancel(self) -> None:
        """Reset the cancel flag. Thread-safe; call it before an eval that must run."""
        self._eng.clear_cancel()

    @property
    def cancel_requested(self) -> bool:
        """Whether the cancel flag is set."""
        return self._eng.cancel_requested()

    def eval_progress(self) -> int:
        """Layers of the running (or last) eval that have finished. Lock-free; for monitoring."""
        return self._eng.eval_progress()

    # --- KV cache (llama.cpp semantics: [p0, p1), negative = open end) --------------------
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> None:
        """Remove `seq_id` from the cells with position in [p0, p1); seq_id < 0 removes all sequences."""
        self._eng.seq_rm(int(seq_id), int(p0), int(p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Add `dst` to the cells of `src` with position in [p0, p1) (no data is copied)."""
        self._eng.seq_cp(int(src), int(dst), int(p0), int(p1))

    def seq_cp_many(self, src: int, dsts: Sequence[int], p0: int = -1, p1: int = -1) -> None:
        """`seq_cp` to several sequences in one pass (e.g. commit a prefix to every live sequence)."""
        self._eng.seq_cp_many(int(src), [int(d) for d in dsts], int(p0), int(p1))

    def seq_keep(self, seq_id: int) -> None:
        """Drop every other sequence: cells of `seq_id` keep only it, all other cells are freed."""
        self._eng.seq_keep(int(seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest cached position of `seq_id`, or -1 if it has no cells."""
        return self._eng.seq_pos_max(int(seq_id))

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest cached position of `seq_id`, or -1 if it has no cells."""
        return self._eng.seq_pos_min(int(seq_id))

    def kv_clear(self) -> None:
        """Free every cell."""
        self._eng.kv_clear()

    def kv_min_resume(self, seq_id: int) -> int:
        """The smallest position `seq_id` can be continued from after a `seq_rm` of its tail: the
        sliding-window cache pruned the cells its window would need below it (0: any position)."""
        return self._eng.kv_min_resume(int(seq_id))

    def kv_used_cells(self) -> int:
        """Cells that belong to at least one sequence."""
        return self._eng.kv_used_cells()

    def stats(self) -> EngineStats:
        """Counters since the engine was opened:

        - evals: eval calls that passed validation
        - evals_cancelled: evals that raised EvalCancelled
        - cancelled_mid_compute: ... of which were aborted after compute had started
        - layer_evals: layers computed, summed over evals
        - layer_evals_skipped: layers not computed because of a cancel
        - t_compute_us: wall time spent in ggml graph compute
        """
        return self._eng.stats()

    def __repr__(self) -> str:
        return (f"LayerEngine({self.path!r}, {self.layer_begin}, {self.layer_end}, arch={self.arch!r}, "
                f"n_ctx={self.n_ctx}, n_threads={self.n_threads})")


def _as_int32(x: Any, name: str) -> np.ndarray:
    """Integer array-like -> contiguous int32 array; refuses floats and values outside int32 instead
    of truncating them (the shape is checked in C++)."""
    a = np.asarray(x)
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {a.dtype}")
    if a.dtype != np.int32:
        if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
            raise ValueError(f"{name} has values outside the int32 range")
        a = a.astype(np.int32)
    return np.ascontiguousarray(a)
