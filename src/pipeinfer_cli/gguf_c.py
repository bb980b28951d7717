"""GGUF metadata through ggml's own C reader (the libggml-base that llama_cpp loads), via ctypes.

The `gguf` Python package parses every element of every array field; for a 151,936-token
vocabulary that takes about 10 s, on every rank of every job. ggml's reader skips what it is not
asked for and takes well under 0.1 s for the same file, so planning and `inspect` use it.
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

GGUF_TYPE_UINT8, GGUF_TYPE_INT8, GGUF_TYPE_UINT16, GGUF_TYPE_INT16 = 0, 1, 2, 3
GGUF_TYPE_UINT32, GGUF_TYPE_INT32, GGUF_TYPE_FLOAT32, GGUF_TYPE_BOOL = 4, 5, 6, 7
GGUF_TYPE_STRING, GGUF_TYPE_ARRAY, GGUF_TYPE_UINT64, GGUF_TYPE_INT64, GGUF_TYPE_FLOAT64 = 8, 9, 10, 11, 12


class _InitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


_LOG_CB = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_lock = threading.Lock()


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    import llama_cpp  # noqa: F401 - loads libggml-base.so.0 from its lib directory

    # By soname, so the loader hands back the copy llama_cpp already mapped: the wheel's
    # libggml-base.so and libggml-base.so.0 are distinct files, and mapping both would put two
    # ggml instances (two sets of global state) in the process.
    try:
        lib = ctypes.CDLL("libggml-base.so.0")
    except OSError:
        lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so.0"))
    p, i64, sz = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t
    sigs = {
        "gguf_init_from_file": (p, [ctypes.c_char_p, _InitParams]),
        "gguf_free": (None, [p]),
        "gguf_find_key": (i64, [p, ctypes.c_char_p]),
        "gguf_get_kv_type": (ctypes.c_int, [p, i64]),
        "gguf_get_arr_type": (ctypes.c_int, [p, i64]),
        "gguf_get_arr_n": (sz, [p, i64]),
        "gguf_get_val_u32": (ctypes.c_uint32, [p, i64]),
        "gguf_get_val_i32": (ctypes.c_int32, [p, i64]),
        "gguf_get_val_u64": (ctypes.c_uint64, [p, i64]),
        "gguf_get_val_f32": (ctypes.c_float, [p, i64]),
        "gguf_get_val_f64": (ctypes.c_double, [p, i64]),
        "gguf_get_val_bool": (ctypes.c_bool, [p, i64]),
        "gguf_get_val_str": (ctypes.c_char_p, [p, i64]),
        "gguf_get_n_tensors": (i64, [p]),
        "gguf_get_tensor_name": (ctypes.c_char_p, [p, i64]),
        "gguf_get_tensor_type": (ctypes.c_int, [p, i64]),
        "gguf_get_tensor_offset": (sz, [p, i64]),
        "gguf_get_tensor_size": (sz, [p, i64]),
        "gguf_get_data_offset": (sz, [p]),
        "ggml_type_name": (ctypes.c_char_p, [ctypes.c_int]),
        "ggml_log_get": (None, [ctypes.POINTER(_LOG_CB), ctypes.POINTER(ctypes.c_void_p)]),
        "ggml_log_set": (None, [_LOG_CB, ctypes.c_void_p]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


@_LOG_CB
def _drop_log(level, text, user_data):  # pragma: no cover - called from C
    return None


@contextmanager
def _quiet(lib):
    """ggml prints its reasons for refusing a file on stderr; we raise a clear error instead."""
    prev_cb, prev_ud = _LOG_CB(), ctypes.c_void_p()
    lib.ggml_log_get(ctypes.byref(prev_cb), ctypes.byref(prev_ud))
    lib.ggml_log_set(_drop_log, None)
    try:
        yield
    finally:
        lib.ggml_log_set(prev_cb, prev_ud)


class GGUFFile:
    """Header, key/values and tensor table of a GGUF file (no tensor data is read)."""

    def __init__(self, path: Path):
        self.lib = _lib()
        with _lock, _quiet(self.lib):
            self.ctx = self.lib.gguf_init_from_file(str(path).encode(), _InitParams(True, None))
        if not self.ctx:
            raise ValueError("ggml could not parse the header (bad or truncated file)")

    def close(self) -> None:
        if self.ctx:
            self.lib.gguf_free(self.ctx)
            self.ctx = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def get(self, key: str, default=None):
        """A scalar or string value; for an array, its length."""
        lib, ctx = self.lib, self.ctx
        kid = lib.gguf_find_key(ctx, key.encode())
        if kid < 0:
            return default
        t = lib.gguf_get_kv_type(ctx, kid)
        if t == GGUF_TYPE_STRING:
            return lib.gguf_get_val_str(ctx, kid).decode("utf-8", errors="replace")
        if t == GGUF_TYPE_ARRAY:
            return lib.gguf_get_arr_n(ctx, kid)
        getter = {GGUF_TYPE_UINT32: lib.gguf_get_val_u32, GGUF_TYPE_INT32: lib.gguf_get_val_i32,
                  GGUF_TYPE_UINT64: lib.gguf_get_val_u64, GGUF_TYPE_FLOAT32: lib.gguf_get_val_f32,
                  GGUF_TYPE_FLOAT64: lib.gguf_get_val_f64, GGUF_TYPE_BOOL: lib.gguf_get_val_bool}.get(t)
        return getter(ctx, kid) if getter else default

    def tensors(self) -> list[tuple[str, str, int, int]]:
        """(name, ggml type name, absolute file offset, bytes) for every tensor."""
        lib, ctx = self.lib, self.ctx
        base = lib.gguf_get_data_offset(ctx)
        out = []
        for i in range(lib.gguf_get_n_tensors(ctx)):
            out.append((lib.gguf_get_tensor_name(ctx, i).decode(), lib.ggml_type_name(lib.gguf_get_tensor_type(ctx, i)).decode().upper(),
                        base + lib.gguf_get_tensor_offset(ctx, i), lib.gguf_get_tensor_size(ctx, i)))
        return out
