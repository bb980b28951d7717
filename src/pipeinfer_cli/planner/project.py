"""Projection: a profile for a cluster that is not here, from stated figures or scaled from a measured one.

Decoding a quantized model on a CPU reads every weight once per run, so one row of a layer costs
its bytes over the node's effective memory bandwidth. Each further row of a batch costs `row_cost`
times that (the batch cost curve: near 0 on a node with compute to spare, near 1 on a node that is
compute-bound at one row, as the 2-core machine this project is measured on is). A prompt chunk is
bound by compute: 2 flops per weight per row at the node's stated flop rate, or by memory if that
is slower. Links cost latency plus bytes over rate. The head's fixed cost per run, and the draft's
per token, come from the same rules (the draft's bytes over bandwidth), or from a measured profile.

Every figure is stated by whoever projects (`ClusterSpec`); nothing is fitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .profile import CostGrid, DraftCosts, LinkCosts, ModelFacts, Profile, RankCosts

ROWS = [1, 2, 3, 4, 5, 6, 8, 12, 16]
PREFILL_ROWS = [16, 64, 256]


@dataclass
class ModelSpec:
    name: str
    n_layer: int
    n_embd: int
    n_vocab: int
    layer_bytes: int  # per layer (the mean)
    output_bytes: int  # LM head
    params_per_layer: float  # weights per layer (for the prefill's flops)


@dataclass
class NodeSpec:
    mem_bandwidth: float  # bytes/s, effective (what a decode run reads at)
    flops: float  # flop/s for quantized matmuls, all cores
    row_cost: float  # each further row of a batch, as a share of the first
    cores: int = 16
    memory: int = 64 << 30
    run_overhead_s: float = 5e-4  # Python and MPI per run (measured here; see BENCHMARKS.md)


@dataclass
class ClusterSpec:
    model: ModelSpec
    node: NodeSpec
    n_nodes: int
    link_bytes_per_s: float
    link_latency_s: float
    draft_bytes: int | None = None  # a draft model's weights; None: no draft model
    draft_on_rank: bool = True  # the draft on a rank of its own (the last node), else on the head
    node_speeds: list[float] = field(default_factory=list)  # per node, relative to `node` (default all 1)


def _layer_decode_s(m: ModelSpec, n: NodeSpec, rows: int, speed: float) -> float:
    first = m.layer_bytes / n.mem_bandwidth
    return first * (1 + n.row_cost * (rows - 1)) / speed


def _layer_prefill_s(m: ModelSpec, n: NodeSpec, rows: int, speed: float) -> float:
    """A prompt chunk: compute-bound (2 flops per weight per row), unless reading the weights is slower."""
    return max(2 * m.params_per_layer * rows / n.flops, m.layer_bytes / n.mem_bandwidth) / speed


def node_costs(spec: ClusterSpec, rank: int) -> RankCosts:
    m, n = spec.model, spec.node
    speed = spec.node_speeds[rank] if rank < len(spec.node_speeds) else 1.0
    decode = CostGrid(ROWS, [0], [[_layer_decode_s(m, n, r, speed) for r in ROWS]])
    prefill = CostGrid(PREFILL_ROWS, [0], [[_layer_prefill_s(m, n, r, speed) for r in PREFILL_ROWS]])
    # The LM head: one row reads the whole matrix; further rows of the same run cost row_cost each.
    # The cost model charges output rows linearly, so each row is charged the mean over a run of
    # about n_draft+1 rows (5): a stated simplification.
    out_first = m.output_bytes / n.mem_bandwidth / speed
    out_row = out_first * (1 + n.row_cost * 4) / 5
    return RankCosts(rank, f"node{rank}", "projected", n.cores, n.cores, n.memory, n.memory, decode, prefill, out_row,
                     n.run_overhead_s)


def cluster_profile(spec: ClusterSpec) -> Profile:
    m = spec.model
    facts = ModelFacts(m.name, m.layer_bytes * m.n_layer + m.output_bytes, "llama", m.n_layer, m.n_embd, m.n_vocab,
                       [m.layer_bytes] * m.n_layer, m.output_bytes)
    ranks = [node_costs(spec, r) for r in range(spec.n_nodes)]
    links = [LinkCosts(a, b, spec.link_latency_s, spec.link_bytes_per_s)
             for a in range(spec.n_nodes) for b in range(spec.n_nodes) if a != b]
    draft = None
    if spec.draft_bytes:
        token_s = spec.draft_bytes / spec.node.mem_bandwidth
        draft = DraftCosts("model", "projected draft", spec.n_nodes - 1 if spec.draft_on_rank else 0, spec.node.cores,
                           token_s, token_s / 16)
    return Profile(facts, ranks, links, draft, created="projected", command="planner/project.py")


def _scaled_grid(g: CostGrid, factor: float) -> CostGrid:
    return CostGrid(list(g.rows), list(g.kv), [[s * factor for s in row] for row in g.s])


def scaled_profile(measured: Profile, model: ModelSpec, n_nodes: int, draft_factor: float | None,
                   draft_on_rank: bool = True) -> Profile:
    """A profile of n_nodes nodes like the measured ones, running `model`: each node takes the costs
    of a measured rank (cycling through them), its layer grids scaled by the ratio of layer bytes and
    its LM head by the ratio of output bytes, so the measured shape stays: the batch cost curve, the
    prompt chunks' rate, the fixed cost per run, the links. The draft's costs are the measured
    draft's times draft_factor (the ratio of the draft models' bytes); None: no draft."""
    src = measured.model
    layer_factor = model.layer_bytes / (sum(src.layer_bytes) / len(src.layer_bytes))
    out_factor = model.output_bytes / src.output_bytes
    ranks = []
    for r in range(n_nodes):
        m = measured.ranks[r % len(measured.ranks)]
        ranks.append(RankCosts(r, f"node{r}", m.cpu, m.cores, m.threads, m.mem_total_bytes, m.mem_available_bytes,
                               _scaled_grid(m.decode, layer_factor), _scaled_grid(m.prefill, layer_factor),
                               m.output_row_s * out_factor, m.run_overhead_s, usable_cpus=m.usable_cpus,
                               quota_cpus=m.quota_cpus, ranks_per_host=1))
    latency = max((lk.latency_s for lk in measured.links), default=0.0)
    rate = min((lk.bytes_per_s for lk in measured.links), default=float("inf"))
    links = [LinkCosts(a, b, latency, rate) for a in range(n_nodes) for b in range(n_nodes) if a != b]
    draft = None
    if draft_factor is not None and measured.draft is not None and measured.draft.kind == "model":
        d = measured.draft
        draft = DraftCosts("model", f"{d.name} scaled x{draft_factor:.3g}", n_nodes - 1 if draft_on_rank else 0,
                           d.threads, d.token_s * draft_factor, d.prompt_token_s * draft_factor)
    facts = ModelFacts(model.name, model.layer_bytes * model.n_layer + model.output_bytes, src.arch, model.n_layer,
                       model.n_embd, model.n_vocab, [model.layer_bytes] * model.n_layer, model.output_bytes)
    return Profile(facts, ranks, links, draft, created=f"scaled from {measured.created or 'a measured profile'}",
                   command=f"planner/project.py scaled_profile of: {measured.command}")
