"""Weights from the head: a model on one node is enough.

Only the head needs the job's model files. At start-up, after the head planned the job (on every
rank, `share_plan_and_weights`):

1. "start": every rank told the head which model files it has (`local_files`, `ModelFiles`).
2. "plan": the head sends every rank the plan and its configuration (the head's options win) and
   the models' sha256 where a rank's copy is not the head's very file (`digests_needed`).
3. Each rank picks its weights (`models/weight_copies.py` `pick_copy`): the head's file when it is
   the same file; its own copy when it has the same size and sha256; else its node cache.
4. "weights": ranks that found none of these say what they need (`Need`), with the tensors of it
   that files of other boundaries in their node cache hold, and the head streams them the rest,
   one rank after the other (`transport/weight_transfer.py`: a stage its rank slice, a draft rank
   the whole draft file); the rank writes the file from both and keeps it in its node cache for
   the next job.

Every rank's report in the JSON says where its weights came from, how many bytes it received and
how long it took (`LoadedWeights`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..models.weight_copies import (ModelFiles, Need, WeightsSource, digests_needed, model_for, pick_copy,
                                    remove_cut_streams, target_need)
from ..transport.mpi_link import Link
from ..transport.weight_transfer import receive_streams, send_streams
from ..planner.job_config import JobConfig
from ..planner.layout import Topology

if TYPE_CHECKING:
    from ..transport.startup import Startup


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


def local_files(cfg: JobConfig) -> ModelFiles:
    """The model files this rank has (its "start" check-in value)."""
    return ModelFiles.here(cfg.model_path, cfg.model_sha256, cfg.model_size,
                           cfg.draft_path, cfg.draft_sha256, cfg.draft_size)


def share_plan_and_weights(link: Link, startup: Startup, cfg: JobConfig, topo: Topology | None, needs_draft: bool,
                           say: Callable[[str], None]) -> tuple[Topology, JobConfig, WeightsSource | None]:
    """Agree on the head's plan (topo, None on the other ranks) and configuration, and get every
    rank its weights (see the module docstring). Returns the topology, the configuration this rank
    runs with (the head's, with this rank's own paths to the weights it loads) and where those
    weights came from."""
    files: list[ModelFiles] = startup.start_values
    remove_cut_streams(whoami(link, startup))
    if link.rank == 0:
        paths, labels = model_paths(cfg), model_labels(cfg)
        loads_draft = needs_draft and cfg.draft_path is not None
        wants = [(p.rank, want) for p in topo.ranks[1:] if (want := model_for(p.role, loads_draft)) is not None]
        digests = digests_needed(files, wants)
        startup.check_in("plan", (topo, cfg, digests))
        send_streams(link, startup, paths, labels, digests, say)
        return topo, cfg, WeightsSource("local", path=str(cfg.model_path))
    topo, head_cfg, digests = startup.check_in("plan")[0]
    mine, head = files[link.rank], files[0]
    # The head's options win (one plan, one mode); the paths are this rank's own, as found below.
    paths = {"target": cfg.model_path, "draft": cfg.draft_path}
    plan = topo.ranks[link.rank]
    want = model_for(plan.role, needs_draft and head_cfg.draft_path is not None)
    source, needs = None, []
    if want is not None:
        layers = tuple(plan.layers) if want == "target" else None
        paths[want], source = pick_copy(mine.of(want), head.of(want), digests.get(want), layers, whoami(link, startup))
        if paths[want] is None:
            needs.append(target_need(digests.get(want), layers) if want == "target" else Need(want, layers))
    for need, path, streamed in receive_streams(link, startup, model_labels(head_cfg), needs, digests):
        paths[need.what], source = path, streamed
    return topo, replace(head_cfg, model_path=paths["target"], draft_path=paths["draft"]), source


def stream_what_ranks_need(link: Link, startup: Startup, cfg: JobConfig, digests: dict[str, str],
                           say: Callable[[str], None]) -> None:
    """Head: the "weights" check-in, then stream each rank what it asked for, one after the other
    (transport/weight_transfer.send_streams: the bytes read by models/weight_slices.py)."""
    send_streams(link, startup, model_paths(cfg), model_labels(cfg), digests, say)


def receive_needs(link: Link, startup: Startup, head_cfg: JobConfig, needs: list[Need], digests: dict[str, str]
                  ) -> list[tuple[Need, Path, WeightsSource]]:
    """A rank: the "weights" check-in with what it needs, then each stream from the head into the
    node cache (transport/weight_transfer.receive_streams): (need, its path, where it came from)."""
    return receive_streams(link, startup, model_labels(head_cfg), needs, digests)


def model_paths(cfg: JobConfig) -> dict[str, Path | None]:
    """The head's file of each model a Need is part of ("target", "draft")."""
    return {"target": cfg.model_path, "draft": cfg.draft_path}


def model_labels(cfg: JobConfig) -> dict[str, str]:
    """The name of each model a Need is part of ("target", "draft"), as the lines on stderr and the
    node cache say it."""
    return {"target": cfg.model_label, "draft": cfg.draft_label}


def whoami(link: Link, startup: Startup) -> str:
    return f"rank {link.rank} (host {startup.host})"
