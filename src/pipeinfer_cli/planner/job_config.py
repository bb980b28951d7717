"""A job's configuration (`JobConfig`): plain data, in the planner's layer, so that the planner
(planner/job_plan.py) plans from it and every module a job goes through (weight streaming, loading,
the head, the stages) names the shape of what it is given without importing the job that runs them.

The launching command builds a JobConfig from its options (cli/job_setup.py); every rank then takes
the head's (runtime/weight_stream.py: one plan, one mode), with its own paths to the weights it loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..decode.draft_spec import DraftSpec
from ..decode.sampling import SamplingParams
from ..decode.session import DecodeOptions
from ..decode.slot_geometry import SlotGeometry
from ..transport.deadlines import DEFAULT_RANK_TIMEOUT_S


@dataclass(frozen=True)
class JobConfig:
    """What every rank of a job runs with: the models, how to decode, the context and the split."""

    model_path: Path
    model_label: str
    draft_path: Path | None  # GGUF draft model, or None
    draft: DraftSpec = field(default_factory=DraftSpec.none)  # parsed from --draft, its model resolved
    sampling: SamplingParams = field(default_factory=SamplingParams)
    decode: DecodeOptions = field(default_factory=DecodeOptions)
    n_ctx: int = 4096
    layer_split: str | None = None
    threads: str | None = None
    debug: bool = False
    # Keep the previous request's KV cells and reuse the longest prefix that is exactly what a fresh
    # prefill computes (decode/prefix_cache.py). Off for generate and bench (honest TTFT figures).
    reuse_prefix: bool = False
    rank_timeout_s: float = DEFAULT_RANK_TIMEOUT_S  # liveness deadline (transport/liveness.py); 0: off
    profile: Path | None = None  # a calibration profile (planner/profile.py), for --layer-split auto
    # What the registry says of the models (None for a path): a rank's copy with this size is taken
    # to have this sha256, as its pull verified (runtime/weight_stream.py).
    model_sha256: str | None = None
    model_size: int | None = None
    draft_sha256: str | None = None
    draft_size: int | None = None
    # serve --parallel N: requests generated at once, each in a KV slot of n_ctx // N cells (rounded
    # down to 256) and its own sequence ids (runtime/parallel.py); load_policy: when a request may
    # speculate beside others (decode/parallel_policy.py).
    parallel: int = 1
    load_policy: str = "yield"

    @property
    def draft_label(self) -> str | None:
        """The draft's name in reports: None, "lookup", the model's label or "lookup+" and it."""
        return self.draft.label

    @property
    def geometry(self) -> SlotGeometry:
        """The KV sequences and cells every stage opens, per request slot (decode/slot_geometry.py)."""
        return SlotGeometry.for_job(self.n_ctx, self.parallel, self.decode.max_inflight, self.decode.max_branches,
                                    drafts=not self.draft.is_none)

    @property
    def slot_ctx(self) -> int:
        """KV cells of one request: all of --ctx with one slot, else its share in whole 256-cell blocks."""
        return self.geometry.cells_per_slot

    @property
    def engine_ctx(self) -> int:
        """KV cells every stage opens: the slots' cells together."""
        return self.geometry.n_ctx
