"""Weights from the head: a model on one node is enough.

Only the head needs the job's model files. At start-up (`share_plan_and_weights`, on every rank):

1. "start": every rank tells the head which model files it has (`model_identity.FileIdentity`).
2. "plan": the head plans the job and sends every rank its configuration (the head's options win)
   and the models' sha256 where a rank's copy is not the head's very file.
3. Each rank picks its weights: the head's file when it is the same file; its own copy when it has
   the same size and sha256; else its node cache (`slice_cache`), whose bytes are checked.
4. "weights": ranks that found none of these say what they need, and the head streams it to them
   one after the other (a stage its rank slice, a draft rank the whole draft file), in chunks with
   at most STREAM_WINDOW of them in flight, so no rank ever holds more than its share plus a few
   chunks. The rank writes the bytes to its node cache, so the next job on that node reads them
   from disk.

The head prints one line per streamed rank and its progress on stderr; every rank's report in the
JSON says where its weights came from, how many bytes it received and how long it took.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import PipeinferError
from ..models.model_identity import FileIdentity, file_sha256, identify
from ..transport.faults import stream_rate_limit
from ..transport.messages import Tag
from ..transport.mpi_link import Link
from ..transport.start_waits import start_timeout_s
from ..wording import human_bytes
from .job_config import JobConfig
from .topology import Topology, plan_config

if TYPE_CHECKING:
    from ..models.weight_slices import SliceSource
    from ..transport.startup import Startup

STREAM_CHUNK_BYTES = 4 << 20
STREAM_WINDOW = 4  # chunks in flight to one rank: bounds the memory a stream takes on both sides
PROGRESS_EVERY_S = 5.0


class WeightsError(PipeinferError):
    """A rank could not get its weights (a stream cut, a damaged copy, a model the head lacks)."""


@dataclass(frozen=True)
class Need:
    """What a rank asks the head to stream: its slice of the target, or the whole draft file."""

    what: str  # "target" or "draft"
    layers: tuple[int, int] | None  # the target's [begin, end); None: the whole file


@dataclass
class WeightsSource:
    """Where this rank's weights came from (its report's "weights" entry)."""

    source: str  # "local" (a model file on this node), "cache" (the node cache) or "stream" (from the head)
    bytes_received: int = 0
    stream_s: float = 0.0
    path: str | None = None
    peak_rss_mib_streamed: float | None = None  # this process's peak RSS once the stream was written

    def to_dict(self) -> dict:
        return {"source": self.source, "bytes_received": self.bytes_received, "stream_s": round(self.stream_s, 3),
                "path": self.path, "peak_rss_mib_streamed": self.peak_rss_mib_streamed}


@dataclass(frozen=True)
class LoadedWeights:
    """A rank's "weights" report (once per job): where they came from, and loading them."""

    source: WeightsSource
    load_s: float
    peak_rss_mib_loading: float
    rss_mib_loaded: float | None
    weight_bytes: int | None  # this rank's share: its layers' weights (a stage), or the draft file

    def as_dict(self) -> dict:
        return {**self.source.to_dict(), "load_s": self.load_s, "peak_rss_mib_loading": self.peak_rss_mib_loading,
                "rss_mib_loaded": self.rss_mib_loaded, "weight_bytes": self.weight_bytes}


@dataclass(frozen=True)
class ModelFiles:
    """The model files one rank has ("start" check-in value); None where it has none."""

    target: FileIdentity | None
    draft: FileIdentity | None

    def of(self, what: str) -> FileIdentity | None:
        """The file of `what` ("target" or "draft", as a `Need` names it)."""
        return getattr(self, what)


def local_files(cfg: JobConfig) -> ModelFiles:
    """The model files this rank has."""
    return ModelFiles(identify(cfg.model_path, cfg.model_sha256, cfg.model_size),
                      identify(cfg.draft_path, cfg.draft_sha256, cfg.draft_size))


def share_plan_and_weights(link: Link, startup: Startup, cfg: JobConfig, needs_draft: bool, files: list[ModelFiles],
                           say: Callable[[str], None]) -> tuple[Topology, JobConfig, WeightsSource | None]:
    """Plan on the head, agree on the configuration and get every rank its weights (see the module
    docstring). files: every rank's `local_files` from the "start" check-in. Returns the topology,
    the configuration this rank runs with (the head's, with this rank's own paths to the weights it
    loads) and where those weights came from."""
    hosts = startup.hosts
    _remove_cut_streams(_whoami(link, startup))
    if link.rank == 0:
        topo = plan_config(cfg, link.size, hosts.count(hosts[0]), needs_draft)
        digests = _digests_for_others(cfg, topo, files, needs_draft)
        startup.check_in("plan", (topo, cfg, digests))
        needs = startup.check_in("weights", [])
        for rank, wanted in enumerate(needs):
            for need in wanted:
                _stream_to(link, _source_for(cfg, need, digests), _label(cfg, need), rank, hosts[rank], need, say)
        return topo, cfg, WeightsSource("local", path=str(cfg.model_path))
    topo, head_cfg, digests = startup.check_in("plan")[0]
    mine = files[link.rank]
    # The head's options win (one plan, one mode); the paths are this rank's own, as found below.
    model_path, draft_path = cfg.model_path, cfg.draft_path
    role = topo.ranks[link.rank].role
    source, needs = None, []
    if role == "stage":
        model_path, source = _pick(mine.target, files[0].target, digests.get("target"),
                                   tuple(topo.ranks[link.rank].layers), _whoami(link, startup))
        if model_path is None:
            needs.append(Need("target", tuple(topo.ranks[link.rank].layers)))
    elif role == "draft" and needs_draft and head_cfg.draft_path is not None:
        draft_path, source = _pick(mine.draft, files[0].draft, digests.get("draft"), None, _whoami(link, startup))
        if draft_path is None:
            needs.append(Need("draft", None))
    startup.check_in("weights", needs)
    for need in needs:
        path, source = _receive(link, _label(head_cfg, need), need, digests)
        if need.what == "target":
            model_path = path
        else:
            draft_path = path
    return topo, replace(head_cfg, model_path=model_path, draft_path=draft_path), source


def _remove_cut_streams(whoami: str) -> None:
    """Every rank at start: the partial files that cut streams of this host left in its node cache
    (a rank killed by SIGKILL while it was sent its weights cannot remove its own) are removed, and
    said in one line on stderr."""
    from ..models import slice_cache

    try:
        removed = slice_cache.remove_dead_partials()
    except OSError:  # an unreadable cache: the stream, if one is needed, reports it
        return
    if removed:
        what = (f"the partial file {removed[0][0]}" if len(removed) == 1
                else f"{len(removed)} partial files")
        size = human_bytes(sum(n for _, n in removed))
        print(f"pipeinfer: {whoami}: removed {what} ({size}) that a cut stream of weights left in the node cache "
              f"{slice_cache.slices_dir()}", file=sys.stderr, flush=True)


def _digests_for_others(cfg: JobConfig, topo: Topology, files: list[ModelFiles], needs_draft: bool) -> dict[str, str]:
    """The sha256 of each model some rank needs and cannot use the head's very file for. Hashing
    a model the registry does not know takes a few seconds once (it is remembered)."""
    out = {}
    head = files[0]
    for plan in topo.ranks[1:]:
        what = "target" if plan.role == "stage" else "draft" if needs_draft and cfg.draft_path is not None else None
        if what is None or what in out:
            continue
        theirs = files[plan.rank].of(what)
        if theirs is None or not theirs.same_file(head.of(what)):
            out[what] = file_sha256(head.of(what))
    return out


def _whoami(link: Link, startup: Startup) -> str:
    return f"rank {link.rank} (host {startup.host})"


def _pick(mine: FileIdentity | None, head: FileIdentity, digest: str | None, layers: tuple[int, int] | None,
          whoami: str) -> tuple[Path | None, WeightsSource | None]:
    """(path, WeightsSource) of the weights this rank can load without a stream, or (None, None)."""
    from ..models import slice_cache

    if mine is not None and mine.same_file(head):
        return Path(mine.path), WeightsSource("local", path=mine.path)
    if mine is not None and mine.size == head.size and file_sha256(mine) == digest:
        return Path(mine.path), WeightsSource("local", path=mine.path)
    path, why = slice_cache.lookup(digest, layers)
    if why is not None:
        print(f"pipeinfer: warning: {whoami}: {why}", file=sys.stderr, flush=True)
    if path is not None:
        return path, WeightsSource("cache", path=str(path))
    return None, None


# -- the stream ------------------------------------------------------------------------------

def _source_for(cfg: JobConfig, need: Need, digests: dict[str, str]) -> SliceSource:
    """Head: the bytes a Need asks for (a stage's slice of the target, or the draft file)."""
    from ..models.weight_slices import stage_slice, whole_file

    if need.what == "target":
        return stage_slice(cfg.model_path, digests["target"], *need.layers)
    return whole_file(cfg.draft_path)


def _label(cfg: JobConfig, need: Need) -> str:
    """The name of the model a Need is part of, as the lines on stderr and the node cache say it."""
    return cfg.model_label if need.what == "target" else cfg.draft_label


def _stream_to(link: Link, src: SliceSource, label: str, rank: int, host: str, need: Need,
               say: Callable[[str], None]) -> None:
    """Head: send one rank the bytes of src (label: the model they are part of). Stops early (quietly) when the rank checked in with an
    error instead (it reports it at the next check-in); raises WeightsError when it stops taking
    the chunks for PIPEINFER_START_TIMEOUT seconds."""
    import hashlib

    from ..models.weight_slices import iter_chunks

    part = "the whole draft file" if need.layers is None else f"layers {need.layers[0]}-{need.layers[1] - 1}"
    say(f"rank {rank} (host {host}) has no copy of {label}: sending it {part} ({human_bytes(src.total)})")
    link.send_pickled(("begin", src.total), rank, Tag.WEIGHTS_CTL)
    digest, sent, t0 = hashlib.sha256(), 0, time.monotonic()
    last_note = t0
    stall_s = start_timeout_s()
    rate = stream_rate_limit()
    for chunk in iter_chunks(src, STREAM_CHUNK_BYTES):
        if rate is not None:
            time.sleep(max(0.0, t0 + sent / rate - time.monotonic()))
        if not _wait_for_window(link, rank, stall_s, host):
            return
        digest.update(chunk)
        link.send_array(np.frombuffer(chunk, np.uint8), rank, Tag.WEIGHTS)
        sent += len(chunk)
        now = time.monotonic()
        if now - last_note >= PROGRESS_EVERY_S:
            last_note = now
            say(f"rank {rank}: {human_bytes(sent)} of {human_bytes(src.total)} ({100 * sent / src.total:.0f} %), "
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


def _receive(link: Link, label: str, need: Need, digests: dict[str, str]) -> tuple[Path, WeightsSource]:
    """A rank: take the stream of one Need (of the model called label) into the node cache; its path
    and source."""
    from ..models.slice_cache import SliceWriter

    stall_s = start_timeout_s()
    _, total = _recv_ctl(link, stall_s, "the start of the stream")
    t0 = time.monotonic()
    with SliceWriter(label, digests[need.what], need.layers, total) as out, _sigterm_raises():
        while out.written < total:
            got = _wait_chunk(link, stall_s, out.written, total)
            out.write(memoryview(link.recv_array(0, Tag.WEIGHTS, np.uint8, got)))
        _, digest = _recv_ctl(link, stall_s, "the end of the stream")
        path = out.commit(digest)
    from ..decode.metrics import peak_rss_mib

    return path, WeightsSource("stream", total, time.monotonic() - t0, str(path), round(peak_rss_mib(), 1))


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
                from ..transport.exits import leave_before_start

                leave_before_start(answer[1])
        if time.monotonic() > deadline:
            return None
        backoff.idle()
