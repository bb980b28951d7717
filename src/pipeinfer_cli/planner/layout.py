"""Which rank does what: target stages in layer order, an optional draft rank, and thread counts,
planned from the model's GGUF header (and a profile, for `--layer-split auto`) with no MPI.

`--layer-split 0.2,0.4,0.4/1` means three target stages holding 20 %, 40 % and 40 % of the layers,
plus one rank that runs the draft model (PipeInfer's notation). Without `/`, the draft runs on
the head (rank 0). Without `--layer-split`, the layers are balanced by bytes of weights. Thread counts are `--threads`
as given, else the CPU share the running rank finds on its host (runtime/topology.default_threads:
a fact the caller gives, `default_threads`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from .layer_split import balanced_split, fractions_of


@dataclass(frozen=True)
class RankPlan:
    rank: int
    role: str  # "head", "stage" or "draft"
    layers: tuple[int, int]  # [begin, end) of the target's layers; (0, 0) for the draft rank
    threads: int


@dataclass(frozen=True)
class Topology:
    ranks: list[RankPlan]
    n_stages: int  # target stages (ranks 0..n_stages-1)
    draft_rank: int | None  # rank of the dedicated draft process, if any
    split_fractions: list[float]
    # What --layer-split auto fitted in each rank's memory besides the weights (planner.split.JobMemory:
    # the KV cache at the job's --ctx, a draft model where it runs); None: a split not checked so.
    memory: object = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def describe(self) -> str:
        return ",".join(f"{f:g}" for f in self.split_fractions) + ("/1" if self.draft_rank is not None else "")


def _auto_ranges(profile, n_stages: int, draft_on_head: bool, memory=None,
                 load: tuple[int, str] = (1, "yield")) -> list[tuple[int, int]]:
    """memory: a planner.split.JobMemory (the job's KV cache and draft), None: the weights alone;
    load: the requests generated at once (serve --parallel) and the load policy, whose aggregate
    the split serves."""
    from .split import auto_split

    if profile is None:
        raise UsageError("--layer-split auto needs a profile of the ranks: run `pipeinfer calibrate MODEL --ranks N "
                         "--out profile.json` with the same ranks, then pass --profile profile.json")
    if n_stages < 1:
        raise UsageError("--layer-split auto/1 needs at least 2 ranks: the draft rank and a target stage")
    if len(profile.ranks) < n_stages:
        raise UsageError(f"--layer-split auto: the profile measured {len(profile.ranks)} rank(s) but the job has "
                         f"{n_stages} target stage(s); calibrate with as many ranks as the job runs")
    if memory is not None and memory.draft_rank is not None and len(profile.ranks) <= memory.draft_rank:
        memory = type(memory)(memory.n_ctx, memory.kv_bytes_per_cell)  # the draft rank was not measured
    return auto_split(profile, list(range(n_stages)), draft_on_head, memory, *load)


def format_layer_ranges(ranks: list) -> str:
    """Each rank's layers as a user reads them, from [begin, end) pairs: '0-13, 14-28, 29, draft'."""
    out = []
    for layers in ranks:
        if not layers or layers[1] <= layers[0]:
            out.append("draft")
        else:
            out.append(str(layers[0]) if layers[1] - layers[0] == 1 else f"{layers[0]}-{layers[1] - 1}")
    return ", ".join(out)


AUTO = "auto"


def parse_layer_split(text: str) -> tuple[list[float] | None, int]:
    """'0.5,0.5/1' -> ([0.5, 0.5], 1 draft rank). Fractions are normalised to sum to 1.
    'auto' (or 'auto/1') -> (None, draft ranks): the split comes from a profile (planner/split.py)."""
    main, _, draft = text.partition("/")
    if is_auto_split(text):
        return None, _draft_ranks(text, draft)
    try:
        fractions = [float(x) for x in main.split(",")]
    except ValueError:
        raise UsageError(f"--layer-split {text!r}: expected comma-separated numbers such as 0.5,0.5 or 0.5,0.5/1") from None
    if any(f <= 0 for f in fractions):
        raise UsageError(f"--layer-split {text!r}: every fraction must be positive")
    total = sum(fractions)
    return [f / total for f in fractions], _draft_ranks(text, draft)


def is_auto_split(text: str | None) -> bool:
    """--layer-split auto (or auto/1): the split comes from a profile."""
    return bool(text) and text.partition("/")[0].strip() == AUTO


def _draft_ranks(text: str, draft: str) -> int:
    if draft and draft.strip() != "1":
        raise UsageError(f"--layer-split {text!r}: after '/' only 1 draft rank is supported (write /1)")
    return 1 if draft else 0


def split_rank_count(text: str | None) -> int | None:
    """The ranks a --layer-split describes (None: it does not say, as 'auto' does not)."""
    if not text:
        return None
    fractions, n_draft = parse_layer_split(text)
    return None if fractions is None else len(fractions) + n_draft


def ranges_from_fractions(fractions: list[float], n_layer: int) -> list[tuple[int, int]]:
    """Consecutive [begin, end) layer ranges, one per fraction, each holding at least one layer.

    Each boundary is the rounded cumulative fraction, then clamped so that every stage before it
    and after it still has a layer: 0.99,0.01 on 30 layers gives 29 and 1, never an empty or
    out-of-range last stage."""
    n_stages = len(fractions)
    if n_stages > n_layer:
        raise UsageError(f"--layer-split has {n_stages} stages but the model has only {n_layer} layers; "
                         f"use at most {n_layer} stages")
    bounds = [0]
    acc = 0.0
    for i, f in enumerate(fractions[:-1], start=1):
        acc += f
        lowest, highest = bounds[-1] + 1, n_layer - (n_stages - i)
        bounds.append(min(max(round(acc * n_layer), lowest), highest))
    bounds.append(n_layer)
    return [(bounds[i], bounds[i + 1]) for i in range(n_stages)]


def parse_threads(text: str | None, world_size: int, default_threads: int = 1) -> list[int]:
    """--threads per rank: one value for every rank, or one per rank; without it, default_threads
    each (the share of its host the rank finds: runtime/topology.default_threads)."""
    if text:
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            raise UsageError(f"--threads {text!r}: expected an integer or one integer per rank, such as 1,1") from None
        if any(v < 1 for v in values):
            raise UsageError(f"--threads {text!r}: thread counts must be >= 1")
        if len(values) == 1:
            return values * world_size
        if len(values) != world_size:
            raise UsageError(f"--threads {text!r}: give one value, or one per rank ({world_size} ranks)")
        return values
    return [default_threads] * world_size


def plan_topology(world_size: int, layer_split: str | None, layer_bytes: list[int], output_bytes: int,
                  threads: str | None, default_threads: int = 1, head_extra: int = 0, profile=None,
                  memory=None, load: tuple[int, str] = (1, "yield")) -> Topology:
    """Assign roles and layers to world_size ranks (checked against --layer-split if given).

    head_extra: bytes of a draft model that runs on the head; the default split then gives the
    head fewer layers, since it reads the draft's weights for every drafted token as well.
    profile: a planner Profile, for --layer-split auto (the layers balanced by measured time);
    memory: what the job holds besides the weights (planner.split.JobMemory), which auto fits in;
    load: requests generated at once and the load policy (serve --parallel N --load-policy P), which
    auto balances the stages for (planner/split.py).
    """
    n_layer = len(layer_bytes)
    fractions, n_draft = parse_layer_split(layer_split) if layer_split else (None, 0)
    auto = bool(layer_split) and fractions is None
    if fractions is not None:
        if len(fractions) + n_draft != world_size:
            raise UsageError(
                f"--layer-split {layer_split!r} describes {len(fractions) + n_draft} ranks but the job has {world_size}; "
                f"use --ranks {len(fractions) + n_draft} or change the split"
            )
        ranges = ranges_from_fractions(fractions, n_layer)
    elif auto:
        ranges = _auto_ranges(profile, world_size - n_draft, head_extra > 0, memory, load)
    else:
        if world_size > n_layer:
            raise UsageError(f"cannot split {n_layer} layers over {world_size} ranks; use at most {n_layer} ranks")
        ranges = balanced_split(layer_bytes, world_size, last_extra=output_bytes, first_extra=head_extra)
    n_stages = len(ranges)
    thr = parse_threads(threads, world_size, default_threads)
    plans = [RankPlan(r, "head" if r == 0 else "stage", ranges[r], thr[r]) for r in range(n_stages)]
    if n_draft:
        plans.append(RankPlan(n_stages, "draft", (0, 0), thr[n_stages]))
    checked = memory if auto else None
    return Topology(plans, n_stages, n_stages if n_draft else None, fractions_of(ranges, n_layer), checked)


@dataclass(frozen=True)
class SplitPlan:
    """How a model's layers split over ranks, as `inspect` shows it (from its GGUF header alone)."""

    layer_split: str  # the split in --layer-split notation
    ranks: list[dict]  # per rank: role, layers, and the bytes it holds and reads per token


def plan_split(info, n_ranks: int, layer_split: str | None = None, draft_bytes: int = 0) -> SplitPlan:
    """Plan the ranks of a model (a gguf_info.ModelInfo) as `generate` does (plan_topology):
    --layer-split if given, else balanced by the bytes each stage reads per token.

    draft_bytes: size of a GGUF draft model; it runs on the head unless the split has a draft
    rank ("/1"). Per rank, `per_token_bytes` is what the split balances: the layers' weights,
    plus the LM head on the last stage and the draft on the rank that runs it. The head's
    token_embd is listed apart (`token_embd_bytes`): it is a lookup table, one row read per
    token, so it costs memory but next to no time. `weight_bytes` is all the target's weights
    the rank holds.
    """
    draft_rank = bool(layer_split and "/" in layer_split)
    head_extra = draft_bytes if not draft_rank else 0
    topo = plan_topology(n_ranks, layer_split, info.layer_bytes, info.output_bytes, None, head_extra=head_extra)
    ranks = []
    last = topo.n_stages - 1
    for plan, fraction in zip(topo.ranks, [*topo.split_fractions, None]):
        b, e = plan.layers
        layers = sum(info.layer_bytes[b:e])
        lm_head = info.output_bytes if plan.role != "draft" and plan.rank == last else 0
        draft = draft_bytes if (plan.role == "draft" or (plan.rank == 0 and not draft_rank)) else 0
        token_embd = info.token_embd_bytes if plan.rank == 0 else 0
        weights = layers + token_embd
        if plan.rank == last:
            weights += info.other_bytes + (0 if info.output_tied and plan.rank == 0 else info.output_bytes)
        ranks.append({
            "rank": plan.rank, "role": plan.role, "layers": [b, e], "n_layers": e - b, "fraction": fraction,
            "layer_bytes": layers, "lm_head_bytes": lm_head, "draft_bytes": draft,
            "per_token_bytes": layers + lm_head + draft, "token_embd_bytes": token_embd, "weight_bytes": weights,
        })
    return SplitPlan(topo.describe(), ranks)


def plan_job(model_path: Path, model_label: str, world_size: int, default_threads: int, layer_split: str | None,
             threads: str | None, draft_path: Path | None = None, needs_draft: bool = False,
             has_draft: bool = True, profile_path: Path | None = None, n_ctx: int = 0,
             model_sha256: str | None = None, load: tuple[int, str] = (1, "yield")) -> Topology:
    """The topology of a job on this model, from its GGUF header alone (well under a second, no MPI):
    the relaunching command checks it before it starts any process.

    has_draft: a draft was given (a model or lookup); a draft rank ('/1') needs one. n_ctx: the
    job's KV cells, which --layer-split auto fits in each rank's memory with the weights.
    model_sha256: the model file's (planner/identity.model_sha256), which a profile for --layer-split
    auto must match; None: the caller matched the profile to the model (plan, which --force may
    override; -M auto's search).
    load: requests generated at once and the load policy (serve --parallel N --load-policy P), for
    --layer-split auto."""
    if layer_split and "/" in layer_split and not has_draft:
        raise UsageError(f"--layer-split {layer_split!r} has a draft rank ('/1'), which needs a draft: "
                         "pass --draft MODEL (or lookup), or drop '/1'")
    from ..models.gguf_info import read_model_info
    from ..native import SUPPORTED_ARCHS

    info = read_model_info(model_path)
    if info.arch not in SUPPORTED_ARCHS:
        raise UsageError(f"{model_label}: architecture {info.arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}")
    # A GGUF draft on the head (no "/1" in the split) costs about its weight bytes per drafted token.
    head_extra = 0
    if needs_draft and draft_path is not None and not (layer_split and "/" in layer_split):
        head_extra = draft_path.stat().st_size
    profile = memory = None
    if profile_path is not None and layer_split and parse_layer_split(layer_split)[0] is None:
        from .split import profile_for_split

        profile, memory = profile_for_split(profile_path, Path(model_path), model_label, info, n_ctx,
                                            draft_path if needs_draft else None, world_size, "/" in layer_split,
                                            model_sha256)
    return plan_topology(world_size, layer_split, info.layer_bytes, info.output_bytes, threads, default_threads,
                         head_extra=head_extra, profile=profile, memory=memory, load=load)

