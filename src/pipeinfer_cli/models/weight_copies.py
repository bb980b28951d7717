"""Which copy of a model's weights a rank loads without a stream, and what it asks for otherwise.

At start-up every rank says which model files it has (`ModelFiles`); the head hashes a model
only when some rank's copy is not its very file (`digests_needed`). A rank then uses, in this
order: the head's very file, its own copy of the same size and sha256, a file in its node cache
that holds its layers, whatever that file's boundaries, its bytes checked (`pick_copy`); without
one it asks the head for a `Need` (naming the tensors of it that cached files hold, which the head
does not send), and the bytes it receives are said in its report as a `WeightsSource`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..wording import human_bytes
from .model_identity import FileIdentity, file_sha256, identify


@dataclass(frozen=True)
class ModelFiles:
    """The model files one rank has ("start" check-in value); None where it has none."""

    target: FileIdentity | None
    draft: FileIdentity | None

    @staticmethod
    def here(model_path: Path | None, model_sha256: str | None, model_size: int | None,
             draft_path: Path | None, draft_sha256: str | None, draft_size: int | None) -> ModelFiles:
        """The files at these paths on this host (a registry model's digest and size known)."""
        return ModelFiles(identify(model_path, model_sha256, model_size), identify(draft_path, draft_sha256, draft_size))

    def of(self, what: str) -> FileIdentity | None:
        """The file of `what` ("target" or "draft", as a `Need` names it)."""
        return getattr(self, what)


@dataclass(frozen=True)
class Need:
    """What a rank asks the head to stream: its slice of the target, or the whole draft file."""

    what: str  # "target" or "draft"
    layers: tuple[int, int] | None  # the target's [begin, end); None: the whole file (a draft's, or
    # the target's when a calibration's probe slices would together cost more)
    cached: tuple[str, ...] = ()  # tensors of it that the rank's node cache holds (not sent)

    def describe(self) -> str:
        if self.layers is None:
            return "the whole draft file" if self.what == "draft" else "the whole model file"
        return f"layers {self.layers[0]}-{self.layers[1] - 1}"


@dataclass
class WeightsSource:
    """Where a rank's weights came from (its report's "weights" entry)."""

    source: str  # "local" (a model file on this node), "cache" (the node cache) or "stream" (from the head)
    bytes_received: int = 0
    stream_s: float = 0.0
    path: str | None = None
    peak_rss_mib_streamed: float | None = None  # this process's peak RSS once the stream was written

    def to_dict(self) -> dict:
        return {"source": self.source, "bytes_received": self.bytes_received, "stream_s": round(self.stream_s, 3),
                "path": self.path, "peak_rss_mib_streamed": self.peak_rss_mib_streamed}


def model_for(role: str, loads_draft: bool) -> str | None:
    """The model a rank other than the head loads, by its role: a stage the target ("target"), a
    draft rank the draft ("draft") when the job drafts with a draft model (loads_draft); None: none."""
    if role == "stage":
        return "target"
    return "draft" if loads_draft else None


def digests_needed(files: list[ModelFiles], wants: Iterable[tuple[int, str]]) -> dict[str, str]:
    """The sha256 of each model ("target", "draft") that some rank wants and cannot use the head's
    very file for. files: every rank's, the head's first; wants: (rank, what) pairs. Hashing a
    model the registry does not know takes a few seconds once (it is remembered)."""
    out = {}
    head = files[0]
    for rank, what in wants:
        if what in out:
            continue
        theirs = files[rank].of(what)
        if theirs is None or not theirs.same_file(head.of(what)):
            out[what] = file_sha256(head.of(what))
    return out


def pick_copy(mine: FileIdentity | None, head: FileIdentity, digest: str | None, layers: tuple[int, int] | None,
              whoami: str) -> tuple[Path | None, WeightsSource | None]:
    """(path, WeightsSource) of the weights this rank can load without a stream, or (None, None).
    A damaged slice in the node cache is said in one warning line (whoami names the rank)."""
    from .slice_reuse import covering_file

    if mine is not None and mine.same_file(head):
        return Path(mine.path), WeightsSource("local", path=mine.path)
    # A copy on another node is used only when its bytes hash to the head's digest (once; remembered
    # per path, size and mtime): a registry copy damaged after its pull would give wrong tokens.
    if mine is not None and mine.size == head.size and file_sha256(mine, trust_registry=False) == digest:
        return Path(mine.path), WeightsSource("local", path=mine.path)
    # The part itself, else a whole copy of the model (which a calibration may have been sent), else
    # any cached slice whose layers include the part (models/slice_reuse.py).
    path, warnings = covering_file(digest, layers)
    for why in warnings:
        print(f"pipeinfer: warning: {whoami}: {why}", file=sys.stderr, flush=True)
    if path is not None:
        return path, WeightsSource("cache", path=str(path))
    return None, None


def remove_cut_streams(whoami: str) -> None:
    """Every rank at start: the partial files that cut streams of this host left in its node cache
    (a rank killed by SIGKILL while it was sent its weights cannot remove its own) are removed, and
    said in one line on stderr."""
    from . import slice_cache

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


def target_need(digest: str | None, layers: tuple[int, int] | None) -> Need:
    """A rank's Need of the target's layers (None: the whole file), with the tensors of them that
    files in its node cache hold already, which the head then does not send (models/slice_reuse.py)."""
    from .slice_cache import touch
    from .slice_reuse import cached_tensors

    held = cached_tensors(digest, layers)
    for path in {c.path for c in held.values()}:  # in use from now: the node cache's cap spares it
        touch(path)
    return Need("target", layers, tuple(sorted(held)))
