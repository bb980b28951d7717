"""A GGUF file as fields, for structure-aware fuzzing.

`scan(data)` walks the bytes the way a GGUF reader does and records every numeric field it passes
(counts, string lengths, value types, array lengths, tensor dimensions, tensor types, offsets) as
a `Field` span, stopping quietly where the bytes stop making sense. The mutator overwrites those
spans with boundary values, so a mutation hits a length or a count instead of a random byte.

`parse(data)` gives the whole file as a `Gguf` (key/values, tensor infos, data section) when it is
well formed, and `Gguf.to_bytes()` writes it back with the alignment padding recomputed; edits on
that model (retyped values, shrunk arrays, changed shapes, removed tensors) stay well formed where
the edit does not deliberately break them.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_INPUT = 1 << 18  # bytes of one fuzz input: the campaign's -max_len (fuzz/campaign.py)

# GGUF value types and their scalar struct formats (little endian).
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, T_UINT64, T_INT64, \
    T_FLOAT64 = range(13)
SCALAR_FORMAT = {T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h", T_UINT32: "<I", T_INT32: "<i",
                 T_FLOAT32: "<f", T_BOOL: "<B", T_UINT64: "<Q", T_INT64: "<q", T_FLOAT64: "<d"}
INT_TYPES = (T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_UINT64, T_INT64)

# ggml tensor types: (block size in elements, bytes per block), for the types the seeds use and
# the mutator picks from. Other type ids are written too, on purpose, as invalid types.
GGML_TYPE_SIZE = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
                  10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 30: (1, 2),
                  24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8)}  # i8 i16 i32 i64 f64: no kernels use them as weights


class Truncated(Exception):
    """The bytes end, or stop being a GGUF file, before the structure does."""


@dataclass
class Field:
    """One numeric field of the file: where it is, how wide, and what it means."""

    offset: int
    width: int  # bytes: 4 or 8 for counts and lengths, the scalar's size for values
    kind: str  # "n_tensors", "n_kv", "str_len", "kv_type", "arr_type", "arr_len", "value", "n_dims", "ne",
    #            "tensor_type", "tensor_offset", "version"
    signed: bool = False
    is_float: bool = False


@dataclass
class KV:
    key: str | bytes
    type: int
    value: object  # scalar, bytes (string), or (elem_type, [values]) for an array


@dataclass
class TensorInfo:
    name: str | bytes
    ne: list[int]
    type: int
    offset: int  # relative to the data section


@dataclass
class Gguf:
    version: int = 3
    kvs: list[KV] = field(default_factory=list)
    tensors: list[TensorInfo] = field(default_factory=list)
    data: bytes = b""

    def get(self, key: str) -> KV | None:
        return next((kv for kv in self.kvs if kv.key == key), None)

    def alignment(self) -> int:
        kv = self.get("general.alignment")
        if kv is not None and kv.type in INT_TYPES and isinstance(kv.value, int) and 0 < kv.value < 1 << 20:
            return kv.value
        return DEFAULT_ALIGNMENT

    def copy(self) -> Gguf:
        """A copy whose keys, arrays and tensors can be edited without changing this one (array
        items are immutable scalars or bytes, the data is immutable bytes)."""
        def value(v):
            return (v[0], list(v[1])) if isinstance(v, tuple) else v
        return Gguf(self.version, [KV(kv.key, kv.type, value(kv.value)) for kv in self.kvs],
                    [TensorInfo(t.name, list(t.ne), t.type, t.offset) for t in self.tensors], self.data)

    def to_bytes(self) -> bytes:
        out = bytearray(MAGIC + struct.pack("<IQQ", self.version, len(self.tensors), len(self.kvs)))
        for kv in self.kvs:
            _put_str(out, kv.key)
            out += struct.pack("<I", kv.type)
            _put_value(out, kv.type, kv.value)
        for t in self.tensors:
            _put_str(out, t.name)
            out += struct.pack("<I", len(t.ne))
            for n in t.ne:
                out += struct.pack("<q" if n < 0 else "<Q", n)
            out += struct.pack("<IQ", t.type, t.offset & (1 << 64) - 1)
        align = self.alignment()
        out += b"\0" * (-len(out) % align)
        return bytes(out + self.data)


def _encode(s: str | bytes) -> bytes:
    return s if isinstance(s, bytes) else s.encode()


def _put_str(out: bytearray, s: str | bytes) -> None:
    b = _encode(s)
    out += struct.pack("<Q", len(b)) + b


def _put_value(out: bytearray, vtype: int, value) -> None:
    if vtype == T_STRING:
        _put_str(out, value)
    elif vtype == T_ARRAY:
        elem_type, items = value
        out += struct.pack("<IQ", elem_type, len(items))
        for item in items:
            _put_value(out, elem_type, item)
    elif vtype in SCALAR_FORMAT:
        fmt = SCALAR_FORMAT[vtype]
        out += struct.pack(fmt, _fit(fmt, value))
    # an unknown type id has no payload we could write; readers must refuse the type itself


def _fit(fmt: str, value):
    """value, wrapped into the range of the struct format (mutations assign any integer)."""
    if fmt[-1] in "fd":
        return float(value)
    bits = struct.calcsize(fmt) * 8
    if isinstance(value, float) and not math.isfinite(value):
        value = 0  # an array retyped from float to an integer type
    value = int(value) & ((1 << bits) - 1)
    if fmt[-1].islower() and value >= 1 << (bits - 1):
        value -= 1 << bits
    return value


class _Reader:
    """Reads fields in order, recording each numeric one; raises Truncated where the bytes end."""

    def __init__(self, data: bytes, fields: list[Field]):
        self.data, self.pos, self.fields = data, 0, fields

    def num(self, fmt: str, kind: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise Truncated(kind)
        (v,) = struct.unpack_from(fmt, self.data, self.pos)
        self.fields.append(Field(self.pos, size, kind, fmt[-1].islower() and fmt[-1] not in "fd", fmt[-1] in "fd"))
        self.pos += size
        return v

    def string(self) -> bytes:
        n = self.num("<Q", "str_len")
        if n > len(self.data) - self.pos:
            raise Truncated("string")
        s = self.data[self.pos:self.pos + n]
        self.pos += n
        return s

    def value(self, vtype: int, max_items: int):
        if vtype == T_STRING:
            return self.string()
        if vtype == T_ARRAY:
            elem_type = self.num("<I", "arr_type")
            n = self.num("<Q", "arr_len")
            if elem_type == T_ARRAY or n > len(self.data) - self.pos:
                raise Truncated("array")
            items = []
            for i in range(n):
                # Only the first elements of a long array are recorded as fields; the rest are
                # read past (a 49,152-token vocabulary would otherwise drown the other fields).
                mark = len(self.fields)
                items.append(self.value(elem_type, max_items))
                if i >= max_items:
                    del self.fields[mark:]
            return elem_type, items
        if vtype not in SCALAR_FORMAT:
            raise Truncated(f"type {vtype}")
        return self.num(SCALAR_FORMAT[vtype], "value")


def _walk(data: bytes, fields: list[Field], max_items: int) -> Gguf:
    r = _Reader(data, fields)
    if data[:4] != MAGIC:
        raise Truncated("magic")
    r.pos = 4
    g = Gguf(version=r.num("<I", "version"))
    n_tensors = r.num("<Q", "n_tensors")
    n_kv = r.num("<Q", "n_kv")
    for _ in range(n_kv):
        key = r.string()
        vtype = r.num("<I", "kv_type")
        g.kvs.append(KV(_decode(key), vtype, r.value(vtype, max_items)))
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.num("<I", "n_dims")
        if n_dims > 8:
            raise Truncated("n_dims")
        ne = [r.num("<q", "ne") for _ in range(n_dims)]
        g.tensors.append(TensorInfo(_decode(name), ne, r.num("<I", "tensor_type"), r.num("<Q", "tensor_offset")))
    start = r.pos + (-r.pos % g.alignment())
    g.data = data[start:]
    return g


def _decode(b: bytes) -> str | bytes:
    try:
        return b.decode()
    except UnicodeDecodeError:
        return b


def scan(data: bytes, max_items: int = 16) -> list[Field]:
    """Every numeric field up to where the structure ends or breaks."""
    fields: list[Field] = []
    try:
        _walk(data, fields, max_items)
    except Truncated:
        pass
    return fields


def parse(data: bytes) -> Gguf | None:
    """The whole file as a Gguf, or None when it is not a complete, well-formed header."""
    try:
        return _walk(data, [], max_items=0)
    except Truncated:
        return None


def tensor_nbytes(t: TensorInfo) -> int | None:
    """Bytes of a tensor's data for a known type, else None."""
    if t.type not in GGML_TYPE_SIZE or not t.ne or any(n <= 0 for n in t.ne):
        return None
    block, size = GGML_TYPE_SIZE[t.type]
    if t.ne[0] % block:
        return None
    n = 1
    for d in t.ne:
        n *= d
    return n // block * size


def relayout(g: Gguf, max_data: int = MAX_INPUT) -> None:
    """Pack the tensors' data one after the other at the file's alignment (after shape edits), zero
    filled where a tensor grew; tensors of unknown size keep their offset. Every tensor gets its
    offset, but only the first max_data bytes of data are kept: the fuzzer cuts its inputs to that
    size anyway, and building megabytes of zeros to cut them off was most of a mutation's time."""
    align = g.alignment()
    new_data = bytearray()
    end = 0  # where the data would end if it were all kept
    for t in g.tensors:
        n = tensor_nbytes(t)
        if n is None or n > 1 << 22:
            continue
        start = end + (-end % align)
        if start < max_data:
            chunk = g.data[t.offset:t.offset + min(n, max_data - start)] if 0 <= t.offset < len(g.data) else b""
            new_data += b"\0" * (start - len(new_data)) + chunk + b"\0" * (min(n, max_data - start) - len(chunk))
        t.offset = start
        end = start + n
    g.data = bytes(new_data)
