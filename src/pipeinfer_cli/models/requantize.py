"""A registry model made on this machine from another: its file requantized by llama.cpp.

A draft's speed on a CPU depends on its tensor types as much as on its size. Qwen2.5's 0.5B has
matrices 896 wide, which K-quants (blocks of 256) cannot hold, so its Q4_K_M file is mostly Q5_0
and Q8_0, which ggml's CPU backend computes row by row; Q4_0 it repacks into interleaved blocks for
AVX2/AVX-512 and NEON. Requantized to Q4_0, the same draft proposes each token in about two thirds
of the CPU time (BENCHMARKS.md, "A faster draft"). The target checks every drafted token, so a
coarser draft changes how often it is right, never the text.

`kind = "requantize"` in models.toml names the source model and the type. The file is written by
llama.cpp's own quantizer (`llama_model_quantize`, what `llama-quantize --allow-requantize` runs)
into a temporary name in the cache and renamed once complete and of the registry's size. Its bytes
depend on how llama.cpp was compiled (a portable build rounds without FMA), so the registry checks
the source file's sha256 and the result's size, not the result's sha256.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from ..errors import DownloadError

Progress = Callable[[int], None]

POLL_S = 0.2  # how often the bytes written so far are reported to the progress bar


def _ftype(qtype: str) -> int:
    import llama_cpp

    return getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype.upper()}")


@contextlib.contextmanager
def _quiet_llama_log():
    """llama.cpp logs a line per tensor while it quantizes; they go through llama-cpp-python's
    logger, which this silences (an fd redirect would also swallow the progress bar)."""
    import llama_cpp._logger  # noqa: F401 - installs the callback that reads this logger's level

    logger = logging.getLogger("llama-cpp-python")
    before = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(before)


def requantize(src: Path, dst: Path, qtype: str, progress: Progress | None = None,
               threads: int | None = None) -> None:
    """Write `src` requantized to `qtype` (models/registry.QUANT_TYPES) at `dst`, reporting the
    bytes written as they grow. Raises DownloadError when llama.cpp refuses."""
    import llama_cpp

    from ..native import ggml_cpu

    ggml_cpu()  # a per-variant ggml has no CPU backend registered until this
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = _ftype(qtype)
    params.allow_requantize = True
    params.nthread = threads or os.cpu_count() or 1
    result: dict[str, int] = {}

    def run() -> None:
        result["rc"] = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))

    seen = 0

    def report() -> None:
        nonlocal seen
        try:
            size = dst.stat().st_size
        except OSError:
            return
        if progress is not None and size > seen:
            progress(size - seen)
        seen = max(seen, size)

    with _quiet_llama_log():
        worker = threading.Thread(target=run, name="requantize", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(POLL_S)
            report()
    if result.get("rc", 1) != 0:
        raise DownloadError(f"llama.cpp could not requantize {src} to {qtype.upper()} (llama_model_quantize returned "
                            f"{result.get('rc')}); check that the file loads (`pipeinfer inspect {src}`)")
