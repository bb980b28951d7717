"""A model's bytes from the head to one rank: in chunks, with at most STREAM_WINDOW of them in
flight, so that no rank ever holds more than its share plus a few chunks; the rank writes them to
its node cache (`models/slice_cache.py`), checked against the sha256 the head sends at the end.
Tensors the rank's node cache holds already, in files of other boundaries, are not sent: the
rank copies them into place from those files, and the sha256 checks them with the rest.

The head says one line per streamed rank and its progress every PROGRESS_EVERY_S seconds. A side
that stops hearing from the other for PIPEINFER_START_TIMEOUT seconds raises `WeightsError`; a
rank that checked in with an error instead of taking its chunks ends the head's send quietly
(the error is reported at the next check-in, transport/startup.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import PipeinferError
from ..models.weight_copies import Need, WeightsSource
from ..wording import human_bytes
from .faults import stream_rate_limit
from .messages import Tag
from .mpi_link import Link
from .start_waits import start_timeout_s

if TYPE_CHECKING:
    from .startup import Startup

STREAM_CHUNK_BYTES = 4 << 20
STREAM_WINDOW = 4  # chunks in flight to one rank: bounds the memory a stream takes on both sides
PROGRESS_EVERY_S = 5.0


class WeightsError(PipeinferError):
    """A rank could not get its weights (a stream cut, a damaged copy, a model the head lacks)."""


def send_streams(link: Link, startup: Startup, paths: dict[str, Path | None], labels: dict[str, str],
                 digests: dict[str, str], say: Callable[[str], None]) -> None:
    """Head: the "weights" check-in (the head's counterpart of receive_streams), then stream each
    rank what it asked for, one after the other: the bytes are read from the head's model files
    (paths: "target", "draft"; models/weight_slices.py: a stage its rank slice, a draft rank the
    whole draft file), less the tensors the rank's node cache holds, and sent (send_weights).
    labels: the name of each model, as the lines on stderr say it."""
    from ..models.weight_slices import stage_slice, whole_file, wire_chunks

    hosts = startup.hosts
    for rank, wanted in enumerate(startup.check_in("weights", [])):
        for need in wanted:
            if need.what == "target" and need.layers is not None:
                src = stage_slice(paths["target"], digests["target"], *need.layers)
            else:
                src = whole_file(paths[need.what])
            skipped = src.skipped(need.cached)
            chunks = wire_chunks(src, STREAM_CHUNK_BYTES, skipped)
            send_weights(link, chunks, src.total, skipped, labels[need.what], need, rank, hosts[rank], say)


def send_weights(link: Link, chunks: Iterable[tuple[bytes, list[memoryview]]], total: int,
                 skipped: list[tuple[int, int, str]], label: str, need: Need, rank: int, host: str,
                 say: Callable[[str], None]) -> None:
    """Head: send one rank `total` bytes, the part of the model `label` that `need` asks for, as
    `chunks`: each chunk of the bytes with its parts that cross the wire, those outside the
    `skipped` (dst_offset, size, tensor) pieces, which the rank's node cache holds (need.cached: it
    copies those itself, at their place; models/weight_slices.wire_chunks). The sha256 sent at the
    end is the whole file's, so the rank checks both alike.
    Stops early (quietly) when the rank checked in with an error instead (it reports it at the next
    check-in); raises WeightsError when it stops taking the chunks for PIPEINFER_START_TIMEOUT seconds."""
    import hashlib

    wire = total - sum(size for _, size, _ in skipped)
    held = f"; {human_bytes(total - wire)} of it from its node cache" if skipped else ""
    say(f"rank {rank} (host {host}) has no copy of {label}: sending it {need.describe()} "
        f"({human_bytes(wire)}{held})")
    link.send_pickled(("begin", total, skipped), rank, Tag.WEIGHTS_CTL)
    digest, sent, t0 = hashlib.sha256(), 0, time.monotonic()
    last_note = t0
    stall_s = start_timeout_s()
    rate = stream_rate_limit()
    for chunk, parts in chunks:
        digest.update(chunk)
        for part in parts:
            if rate is not None:
                time.sleep(max(0.0, t0 + sent / rate - time.monotonic()))
            if not _wait_for_window(link, rank, stall_s, host):
                return
            link.send_array(np.frombuffer(part, np.uint8), rank, Tag.WEIGHTS)
            sent += len(part)
        now = time.monotonic()
        if now - last_note >= PROGRESS_EVERY_S and wire:
            last_note = now
            say(f"rank {rank}: {human_bytes(sent)} of {human_bytes(wire)} ({100 * sent / wire:.0f} %), "
                f"{human_bytes(sent / (now - t0))}/s")
    link.send_pickled(("end", digest.hexdigest()), rank, Tag.WEIGHTS_CTL)
    if not _wait_for_window(link, rank, stall_s, host, limit=0):
        return
    took = time.monotonic() - t0
    say(f"rank {rank}: {human_bytes(sent)} in {took:.1f} s ({human_bytes(sent / max(took, 1e-9))}/s); "
        "it keeps them in its node cache for the next job")


def _wait_for_window(link: Link, rank: int, stall_s: float, host: str, limit: int = STREAM_WINDOW - 1) -> bool:
    """Head: wait until at most `limit` sends are in flight. False when the rank checked in with an
    error instead of taking them (it is reported at the next check-in)."""
    backoff = link.backoff(hi=5e-3)
    last_count, last_change = link.sends_in_flight(), time.monotonic()
    while link.sends_in_flight() > limit:
        if link.probe(rank, Tag.STARTUP) is not None:
            return False
        link.progress_sends()
        count = link.sends_in_flight()
        if count != last_count:
            last_count, last_change = count, time.monotonic()
        elif time.monotonic() - last_change > stall_s:
            raise WeightsError(f"rank {rank} (host {host}) stopped taking its weights: nothing was received for "
                               f"{stall_s:g} s; check the network between it and the head ({_TIMEOUT_HINT})")
        backoff.idle()
    return True


_TIMEOUT_HINT = "PIPEINFER_START_TIMEOUT sets how long to wait"


def receive_streams(link: Link, startup: Startup, labels: dict[str, str], needs: list[Need],
                    digests: dict[str, str]) -> list[tuple[Need, Path, WeightsSource]]:
    """A rank: the "weights" check-in with what it needs, then each stream from the head into the
    node cache: (need, its path, where it came from). labels: the name of each model ("target",
    "draft") as the lines on stderr and the node cache say it. A node cache that cannot take them
    fails here, before the head starts a stream."""
    from ..models.slice_cache import check_writable

    if needs:
        check_writable()
    startup.check_in("weights", needs)
    out = []
    for need in needs:
        path, source = receive_weights(link, labels[need.what], need, digests[need.what])
        out.append((need, path, source))
    return out


def receive_weights(link: Link, label: str, need: Need, model_sha256: str) -> tuple[Path, WeightsSource]:
    """A rank: take the stream of one Need (of the model called label, whose sha256 names it in the
    node cache) into the node cache, copying the tensors the head skipped from the cached files
    that hold them; its path and source."""
    from ..models.cache_budget import MAX_ENV, cache_cap, describe_cap, drop_included, make_room
    from ..models.slice_cache import SliceWriter, read_entry, touch
    from ..models.slice_reuse import cached_tensors

    stall_s = start_timeout_s()
    begin = _recv_ctl(link, stall_s, "the start of the stream")
    total, skipped = begin[1], list(begin[2]) if len(begin) > 2 else []
    copies = cached_tensors(model_sha256, need.layers) if skipped else {}
    missing = [name for _, _, name in skipped if name not in copies]
    if missing:  # removed since the rank asked (another job of this host pruned its node cache)
        raise WeightsError(f"the node cache no longer holds {missing[0]} of {label}, which the head did not send; "
                           "run the job again")
    t0, received = time.monotonic(), 0
    keep = {copies[name].path for _, _, name in skipped}
    _say_removed(make_room(total, keep), f"(those no job used for longest) to stay under {describe_cap(cache_cap())} "
                 f"({MAX_ENV})")
    with SliceWriter(label, model_sha256, need.layers, total) as out, _sigterm_raises():
        while out.written < total:
            if skipped and out.written == skipped[0][0]:
                _copy_tensor(out, copies[skipped.pop(0)[2]])
                continue
            got = _wait_chunk(link, stall_s, out.written, total)
            block = link.recv_array(0, Tag.WEIGHTS, np.uint8, got)
            out.write(memoryview(block))
            received += len(block)
        _, digest = _recv_ctl(link, stall_s, "the end of the stream")
        path = out.commit(digest)
    for source in keep:  # the files it copied from were used too (least recently used goes first)
        touch(source)
    written = read_entry(path)
    if written is not None:
        _say_removed(drop_included(written), f"(the new {written.describe()} holds their layers)")
    from ..process_memory import peak_rss_mib

    return path, WeightsSource("stream", received, time.monotonic() - t0, str(path), round(peak_rss_mib(), 1))


def _say_removed(removed: list, why: str) -> None:
    """One line on stderr for files removed from this node's cache (models/cache_budget.py)."""
    if not removed:
        return
    import socket
    import sys

    from ..models.slice_cache import slices_dir

    what = ", ".join(f"{e.model} {e.describe()}" for e in removed[:3]) + (" …" if len(removed) > 3 else "")
    print(f"pipeinfer: host {socket.gethostname()}: removed {len(removed)} file(s) ({what}; "
          f"{human_bytes(sum(e.size for e in removed))}) from the node cache {slices_dir()} {why}",
          file=sys.stderr, flush=True)


def _copy_tensor(out, copy) -> None:
    """Append a cached tensor's bytes (models/slice_reuse.TensorCopy) to the file being written."""
    import os

    fd = os.open(copy.path, os.O_RDONLY)
    try:
        done = 0
        while done < copy.size:
            block = os.pread(fd, min(STREAM_CHUNK_BYTES, copy.size - done), copy.offset + done)
            if not block:
                raise WeightsError(f"the cached {copy.path.name} ends inside a tensor; run `pipeinfer models prune` "
                                   "and the job again")
            out.write(block)
            done += len(block)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _sigterm_raises():
    """While a stream is written, SIGTERM (a launcher stopping the job) raises, so that the partial
    file is removed on the way out. (SIGKILL cannot be caught: its partial file is removed when the
    next job starts a rank on this host, or by `pipeinfer models prune`.)"""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        raise WeightsError("stopped by SIGTERM while the weights were streamed")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _recv_ctl(link: Link, stall_s: float, what: str):
    if _wait_from_head(link, Tag.WEIGHTS_CTL, stall_s) is None:
        raise WeightsError(f"{what} of the weights from the head did not arrive within {stall_s:g} s ({_TIMEOUT_HINT})")
    return link.recv_pickled(0, Tag.WEIGHTS_CTL)


def _wait_chunk(link: Link, stall_s: float, done: int, total: int):
    got = _wait_from_head(link, Tag.WEIGHTS, stall_s)
    if got is None:
        raise WeightsError(f"the weights from the head stopped after {human_bytes(done)} of {human_bytes(total)}: "
                           f"nothing arrived for {stall_s:g} s; check the network between this host and the head "
                           f"({_TIMEOUT_HINT})")
    return got


def _wait_from_head(link: Link, tag: Tag, stall_s: float):
    """The head's next message of this tag, or None after stall_s seconds without one. A head that
    failed meanwhile (its start-up answer is an abort) ends this rank the way a check-in would."""
    deadline = time.monotonic() + stall_s
    backoff = link.backoff(hi=5e-3)
    while True:
        got = link.probe(0, tag)
        if got is not None:
            return got
        if link.probe(0, Tag.STARTUP) is not None:
            answer = link.recv_pickled(0, Tag.STARTUP)
            if answer[0] == "abort":
                from .exits import leave_before_start

                leave_before_start(answer[1])
        if time.monotonic() > deadline:
            return None
        backoff.idle()
