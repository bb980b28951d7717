"""What a rank without the model file is sent: the bytes of its slice, in file order.

A target stage gets a rank slice, a valid GGUF file with every key/value of the model and only the
tensors of its layer range (plus token_embd on the first stage and the LM head on the last), laid
out by the native `gguf_slice_layout`; the layer engine loads it like the whole file, so the
weights, and the tokens, are the model's own bytes. A draft rank gets the whole draft file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")
_FIRST_STAGE = ("token_embd.weight",)
_LAST_STAGE = ("output_norm.weight", "output.weight", "output.bias")


def stage_tensor_names(names: list[str], n_layer: int, begin: int, end: int) -> list[str]:
    """The tensors a stage holding layers [begin, end) of n_layer needs, in file order: its
    layers, token_embd on the first stage (and on the last when the model ties its LM head to
    it), the output norm and head on the last, and every tensor of no layer (rope_freqs)."""
    first, last = begin == 0, end == n_layer
    tied = "output.weight" not in names
    keep = []
    for name in names:
        m = _LAYER_TENSOR.match(name)
        if m is not None:
            wanted = begin <= int(m.group(1)) < end
        elif name in _FIRST_STAGE:
            wanted = first or (last and tied)
        elif name in _LAST_STAGE:
            wanted = last
        else:
            wanted = True
        if wanted:
            keep.append(name)
    return keep


@dataclass(frozen=True)
class SliceSource:
    """How to produce a slice's bytes from the source file: `meta`, then each (src_offset, size,
    dst_offset) piece, zeros filling the gaps up to `total` bytes."""

    path: Path
    meta: bytes
    pieces: list[tuple[int, int, int]]
    total: int
    names: tuple[str, ...] = ()  # the tensor of each piece (a stage slice's; none for a whole file)

    def skipped(self, held: Iterable[str]) -> list[tuple[int, int, str]]:
        """(dst_offset, size, name) of each piece whose tensor the receiver holds already, in order."""
        held = set(held)
        return [(dst, size, name) for (_, size, dst), name in zip(self.pieces, self.names) if name in held]


def stage_slice(path: Path, sha256: str, begin: int, end: int) -> SliceSource:
    from .. import _native

    md = _native.gguf_metadata(str(path))
    arch = md["kv"].get("general.architecture")
    n_layer = int(md["kv"][f"{arch}.block_count"])
    names = stage_tensor_names([t[0] for t in md["tensors"]], n_layer, begin, end)
    meta, pieces, total = _native.gguf_slice_layout(str(path), names, sha256, begin, end)
    return SliceSource(Path(path), meta, [tuple(p) for p in pieces], total, tuple(names))


def whole_file(path: Path) -> SliceSource:
    size = Path(path).stat().st_size
    return SliceSource(Path(path), b"", [(0, size, 0)], size)


def iter_chunks(src: SliceSource, chunk_bytes: int) -> Iterator[bytes]:
    """The slice's bytes in order, in chunks of at most chunk_bytes, read with pread (the source
    is never held in memory)."""
    pending = bytearray()

    def flush_full() -> Iterator[bytes]:
        while len(pending) >= chunk_bytes:
            yield bytes(pending[:chunk_bytes])
            del pending[:chunk_bytes]

    pending += src.meta
    yield from flush_full()
    pos = len(src.meta)
    fd = os.open(src.path, os.O_RDONLY)
    try:
        for src_off, size, dst_off in src.pieces:
            pending += bytes(dst_off - pos)  # alignment padding
            yield from flush_full()
            pos = dst_off
            done = 0
            while done < size:
                want = min(chunk_bytes - len(pending), size - done)  # flush_full keeps pending below a chunk
                block = os.pread(fd, want, src_off + done)
                if not block:
                    raise OSError(f"{src.path} ends at byte {src_off + done}, inside a tensor")
                pending += block
                done += len(block)
                yield from flush_full()
            pos += size
        pending += bytes(src.total - pos)
        yield from flush_full()
        if pending:
            yield bytes(pending)
    finally:
        os.close(fd)


def wire_chunks(src: SliceSource, chunk_bytes: int, skipped: list[tuple[int, int, str]]
                ) -> Iterator[tuple[bytes, list[memoryview]]]:
    """The slice's bytes as the head streams them: each chunk (`iter_chunks`), which its sha256
    covers, with the parts of it that cross the wire when the receiver holds the `skipped` pieces
    (`outside`)."""
    at = 0
    for chunk in iter_chunks(src, chunk_bytes):
        yield chunk, list(outside(chunk, at, skipped))
        at += len(chunk)


def outside(chunk: bytes, at: int, skipped: list[tuple[int, int, str]]) -> Iterator[memoryview]:
    """The parts of a chunk of the slice (starting at byte `at`) that lie outside the skipped
    pieces, in order: what crosses the wire when the receiver holds those pieces. A part never
    runs into a skipped piece, so the receiver, writing in order, meets each skipped piece exactly
    where a part ended."""
    view, end, pos = memoryview(chunk), at + len(chunk), at
    for start, size, _ in skipped:
        if start + size <= pos:
            continue
        if start >= end:
            break
        if start > pos:
            yield view[pos - at:start - at]
        pos = min(end, start + size)
    if pos < end:
        yield view[pos - at:]
