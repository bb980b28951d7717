"""Everything needed to reproduce a benchmark: versions, model checksums, topology, host facts."""

from __future__ import annotations

import hashlib
import os
import platform
import socket
from pathlib import Path


def versions() -> dict:
    from .. import __version__

    out = {"pipeinfer": __version__, "python": platform.python_version()}
    try:
        import llama_cpp

        out["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        out["llama_cpp_python"] = None
    try:
        from .. import _native

        out["ggml"] = _native.ggml_version()
        out["ggml_cpu"] = _ggml_cpu_variant()
    except ImportError:
        out["ggml"] = out["ggml_cpu"] = None
    import mpi4py
    from mpi4py import MPI

    out["mpi4py"] = mpi4py.__version__
    out["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0]
    import numpy

    out["numpy"] = numpy.__version__
    return out


def _ggml_cpu_variant() -> str | None:
    """The CPU backend the figures were computed with: a variant of a per-variant ggml ("zen4",
    "haswell", ...) or "builtin" (a ggml with one CPU backend inside, native or portable)."""
    from ..errors import GgmlCpuError
    from ..native import ggml_cpu

    try:
        return ggml_cpu()["variant"]
    except GgmlCpuError:
        return None


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def model_facts(label: str | None, path: Path | None, registry_sha256: str | None) -> dict | None:
    """Name, file and sha256 of a model: the registry's checksum (verified at pull) or computed for a path."""
    if path is None:
        return None if label is None else {"name": label, "path": None, "sha256": None}
    return {"name": label, "path": str(path), "size": path.stat().st_size,
            "sha256": registry_sha256 or file_sha256(path),
            "sha256_source": "registry" if registry_sha256 else "computed"}


def model_ref_facts(ref, label: str | None = None) -> dict | None:
    """model_facts of a resolved model (a ModelRef), or of `label` without one (lookup, or None)."""
    if ref is None:
        return model_facts(label, None, None)
    return model_facts(ref.label, ref.path, ref.entry.sha256 if ref.entry else None)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The SIMD extensions ggml's CPU kernels care about."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [f for f in ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]


def mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def host_facts() -> dict:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"hostname": socket.gethostname(), "cpu_model": cpu_model(), "cores": os.cpu_count(),
            "cores_usable": usable, "cpu_flags": cpu_flags(), "mem_total_gib": mem_total_gib(),
            "os": f"{platform.system()} {platform.release()}", "machine": platform.machine(),
            # 1/5/15-minute load averages when the facts were taken: above the job's own ranks'
            # threads, something else competed for the cores.
            "load_avg": load}


def topology(record: dict) -> dict:
    """World size, layer split and per-rank role/layers/threads, from any record of the job."""
    ranks = [{k: r.get(k) for k in ("rank", "role", "layers", "threads")} for r in record["ranks"]]
    return {"world_size": len(ranks), "layer_split": record["layer_split"], "ranks": ranks,
            "threads_total": sum(r["threads"] or 0 for r in ranks)}
