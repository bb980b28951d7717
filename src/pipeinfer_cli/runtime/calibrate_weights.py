"""The weights `pipeinfer calibrate` times on each rank: a model on the head is enough.

Every rank times the same probe (calibrate_probes.py): the k layers before the last one, and the
last one: one range [n - 1 - k, n), one slice. A rank uses, in this order (as a job's ranks do,
runtime/weight_stream.py):

1. its own copy of the model: the head's very file, or one of the same size and sha256;
2. its node cache: the probe's own slice from an earlier calibration, a whole copy, or any cached
   slice of the model that holds the probe's layers (a job's last stage often does), its bytes
   checked against their sha256 (models/slice_reuse.py);
3. else the head streams it the probe's slice (less the tensors of it that cached files of other
   boundaries hold), or the whole model file when that is no larger (a small model: its probe
   holds nearly every layer), and the whole draft file to the rank that times the draft; it keeps
   them in its node cache for the next calibration or job (a job's stage reads a cached file that
   holds its layers, or copies the tensors it holds).

The head plans the job (the calibration's topology, for each count of ranks per host that occurs)
and reads the model's header for every rank, so a rank without the file learns its threads, the
layer sizes and the probe from it. The head says what it streams, with progress, on stderr.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..models.weight_copies import ModelFiles, Need, digests_needed, pick_copy, remove_cut_streams, target_need
from ..transport.mpi_link import Link
from .calibrate_probes import PROBE_BYTES, ProbeSpec, probe_layers
from ..planner.job_config import JobConfig
from ..planner.job_plan import layout_of
from ..planner.layout import Topology
from .topology import default_threads
from .weight_stream import receive_needs, stream_what_ranks_need, whoami

if TYPE_CHECKING:
    from ..models.gguf_info import ModelInfo
    from ..transport.startup import Startup


def probe_parts(layer_bytes: list[int], budget: int = PROBE_BYTES) -> list[tuple[int, int]]:
    """The layer ranges a rank's probe loads: one, from its first probe layer to the last layer."""
    return [(probe_layers(layer_bytes, budget)[0], len(layer_bytes))]


def covering_slice(model_sha256: str | None, part: tuple[int, int]) -> Path | None:
    """A cached file of this model that holds the layers [begin, end) of `part` (the probe's own
    slice first, then a whole copy, then any slice that includes them), its bytes checked; None
    when the node cache has none."""
    from ..models.slice_reuse import covering_file

    return covering_file(model_sha256, part)[0]


def share_probe_weights(link: Link, startup: Startup, cfg: JobConfig, spec: ProbeSpec,
                        runs_draft: Callable[[ProbeSpec, Topology, int], bool],
                        say: Callable[[str], None]) -> tuple[Topology, ModelInfo, ProbeSpec]:
    """(this rank's topology, the model's header facts, this rank's ProbeSpec with its own paths).
    Runs on every rank after the "start" check-in, whose values are every rank's model files. The
    head's ProbeSpec wins (a rank without the draft file would not know it times a draft)."""
    from ..models.gguf_info import read_model_info

    files = startup.start_values
    hosts = startup.hosts
    remove_cut_streams(whoami(link, startup))
    if link.rank == 0:
        info = read_model_info(cfg.model_path)
        counts = {hosts.count(h) for h in hosts}
        topos = {c: layout_of(cfg, link.size, default_threads(c), not cfg.draft.is_none) for c in counts}
        digests = digests_needed(files, _wants(cfg, spec, topos[hosts.count(hosts[0])], runs_draft, len(files)))
        startup.check_in("plan", (topos, info, digests, spec))
        stream_what_ranks_need(link, startup, cfg, digests, say)
        return topos[hosts.count(hosts[0])], info, spec
    topos, info, digests, spec = startup.check_in("plan")[0]
    topo = topos[hosts.count(hosts[link.rank])]
    paths, needs = _pick_probe(link, startup, files, digests, info, runs_draft(spec, topo, link.rank), spec.probe_bytes)
    for need, path, _ in receive_needs(link, startup, cfg, needs, digests):
        if need.what == "draft":
            paths["draft"] = path
        elif need.layers is not None:
            paths[need.layers] = path
        else:  # the whole model file: every part still missing
            paths.update({p: path for p, have in paths.items() if have is None and p != "draft"})
    return topo, info, _with_paths(spec, paths, probe_parts(info.layer_bytes, spec.probe_bytes))


def _wants(cfg: JobConfig, spec: ProbeSpec, topo: Topology, runs_draft: Callable[[ProbeSpec, Topology, int], bool],
           n_ranks: int) -> list[tuple[int, str]]:
    """(rank, model) for every rank but the head: each times the target, and the draft where it runs it."""
    wants = [(r, "target") for r in range(1, n_ranks)]
    if cfg.draft_path is not None:
        wants += [(r, "draft") for r in range(1, n_ranks) if runs_draft(spec, topo, r)]
    return wants


def _pick_probe(link: Link, startup: Startup, files: list[ModelFiles], digests: dict, info: ModelInfo,
                draft: bool, budget: int) -> tuple[dict[tuple[int, int] | str, str | None], list[Need]]:
    """This rank's paths (by part, and "draft") it has without a stream, and the Needs it asks for:
    the probe's missing slices, or the whole model file when they would together cost more (a small
    model, whose probe holds nearly every layer and whose slices each carry its embedding table)."""
    mine, head = files[link.rank], files[0]
    paths: dict[tuple[int, int] | str, str | None] = {}
    whole, _ = pick_copy(mine.target, head.target, digests.get("target"), None, whoami(link, startup))
    for part in probe_parts(info.layer_bytes, budget):
        paths[part] = whole or covering_slice(digests.get("target"), part)
    needs = probe_needs(info, [p for p in paths if paths[p] is None], digests.get("target"))
    if draft and head.draft is not None:
        paths["draft"], _ = pick_copy(mine.draft, head.draft, digests.get("draft"), None, whoami(link, startup))
        if paths["draft"] is None:
            needs.append(Need("draft", None))
    return paths, needs


def probe_needs(info: ModelInfo, missing: list[tuple[int, int]], digest: str | None = None) -> list[Need]:
    """What a rank asks for the probe's parts it lacks: their slices (less the tensors its node
    cache holds), or the whole model file when the slices would together be as large."""
    if missing and sum(slice_bytes(info, p) for p in missing) >= info.file_size:
        return [Need("target", None)]
    return [target_need(digest, p) for p in missing]


def slice_bytes(info: ModelInfo, part: tuple[int, int]) -> int:
    """About the bytes of a rank slice of these layers (models/weight_slices.py): its layers, the
    embedding table on the first stage and the LM head on the last (tied: the same table again)."""
    b, e = part
    n = len(info.layer_bytes)
    return (sum(info.layer_bytes[b:e]) + (info.token_embd_bytes if b == 0 else 0)
            + (info.output_bytes + info.other_bytes if e == n else 0))


def _with_paths(spec: ProbeSpec, paths: dict, parts: list[tuple[int, int]]) -> ProbeSpec:
    first, last = str(paths[parts[0]]), str(paths[parts[-1]])
    draft = paths.get("draft")
    return dataclasses.replace(spec, model_path=first, last_path=last,
                               draft_path=str(draft) if draft is not None else spec.draft_path)
