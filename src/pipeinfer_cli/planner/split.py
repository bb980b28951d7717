"""`--layer-split auto`: the layers balanced by measured time per rank, not by bytes.

Each stage's cost is the measured time of a typical request on it (TYPICAL_PROMPT prompt tokens in
chunks, TYPICAL_GEN one-row decoding runs): its layers at the rank's own seconds per layer for each
phase, the LM head's rows on the last stage, and on the head its own work besides its layers
(`HeadLoad`): a draft model's evals when it drafts there, charged by the tokens it drafts per
generated token (not one per generated token: pipeinfer drafts ahead of what it commits, and a
rejected draft was drafted all the same), and its bookkeeping of every speculative result it
verifies and commits (its measured fixed cost per run, once more per such result). Both phases count, so neither the prompt (where the LM head reads one row) nor decoding is
balanced at the other's expense. A rank gets no share its memory cannot hold: its weights, the KV
cache of its layers at the job's --ctx and the draft model it runs must fit in MEMORY_USE of its
host's available memory, divided among the ranks that share the host.

For N requests at once (`serve --parallel N`, `plan --parallel N`) the objective is the aggregate
throughput: every stage does its part of every request, so N requests in flight finish at most as
fast as the slowest stage's work per request allows, and the split that minimises that stage's
time (what auto_split minimises anyway) maximises the aggregate. The work counted is the same typical
request, except the draft: under the default load policy (`yield`) nobody speculates once the
requests running fill the stages (N >= stages), so a draft model on the head costs it nothing
then and does not take layers from it; with fewer requests than stages the spare stages carry
speculation, and the draft counts as for one request. Under `round-robin` requests speculate as
if alone (the draft counts), under `no-spec` never (it does not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UsageError
from .layer_split import min_max_split
from .costs import grid_seconds
from ..wording import human_bytes, plural
from .profile import Profile

if TYPE_CHECKING:
    from ..models.gguf_info import ModelInfo

TYPICAL_PROMPT = 256
TYPICAL_GEN = 128
TYPICAL_KV = 512
# Drafted tokens per generated token when nothing simulated the job's mode: pipeinfer at its default
# settings (n_draft 4, p_accept 0.5, 4 runs in flight) and the assumed 60 % acceptance drafts about
# this many on 2 to 4 stages (planner/placement.py measures it in the simulation instead).
DRAFT_TOKENS_PER_TOKEN = 2.0
MEMORY_USE = 0.9  # of a host's available memory, for the weights, KV caches and drafts of its ranks


@dataclass(frozen=True)
class JobMemory:
    """What a job holds besides the target's weights: the KV cache (per layer and cell, times the
    job's --ctx cells) and a draft model (its weights and KV cache) on the rank that runs it."""

    n_ctx: int = 0
    kv_bytes_per_cell: int = 0  # one layer's K and V for one cell (f16)
    draft_bytes: int = 0  # the draft's weights and KV cache at n_ctx
    draft_rank: int | None = None  # the profile rank of a draft rank; None: the draft is on the head

    def kv_bytes(self, n_layers: int) -> int:
        return n_layers * self.n_ctx * self.kv_bytes_per_cell


@dataclass(frozen=True)
class HeadLoad:
    """The head's own work per generated token besides its layers, in a mode that drafts: the
    tokens a draft model on the head drafts (evals at the draft's measured seconds per token) and
    the speculative results it verifies and commits (each at the head's measured fixed cost per
    run, `run_overhead_s`: the bookkeeping of one more run through its loop). The simulation of the
    job's mode gives both (planner/placement.py); the defaults are the estimate above."""

    draft_tokens: float = DRAFT_TOKENS_PER_TOKEN
    commits: float = 0.0


def profile_for_split(profile_path: Path, model_path: Path, model_label: str, info: ModelInfo, n_ctx: int,
                      draft_path: Path | None, world_size: int, draft_rank: bool,
                      model_sha256: str | None = None) -> tuple[Profile, JobMemory]:
    """What `--layer-split auto` splits by: the profile (checked to be of this model when the
    caller gives the model file's sha256, planner/identity.model_sha256; None: the caller checked
    it), and the job's memory besides the target's weights: the KV cache at n_ctx cells (info: the
    target's gguf_info.ModelInfo), and a draft model's weights and its own KV cache on the rank
    that runs it (draft_path: None when the job runs no draft model)."""
    profile = Profile.load(profile_path)
    if model_sha256 is not None:
        profile.check_model(model_label, model_path.stat().st_size, f"the profile {profile_path}", model_sha256)
    draft_bytes = 0 if draft_path is None else draft_model_bytes(draft_path, n_ctx)
    return profile, JobMemory(n_ctx, info.kv_bytes_per_cell, draft_bytes, world_size - 1 if draft_rank else None)


def draft_model_bytes(path: Path, n_ctx: int) -> int:
    """A draft model's memory on the rank that runs it: its file's weights and its own KV cache at
    n_ctx cells (the runtime's check before loading counts it the same way)."""
    from ..models.gguf_info import read_model_info

    d = read_model_info(path)
    return d.file_size + d.n_layer * n_ctx * d.kv_bytes_per_cell


def drafts_under_load(parallel: int, n_stages: int, load_policy: str = "yield") -> bool:
    """Whether requests still speculate with `parallel` of them on `n_stages` stages, under the load
    policy of decode/parallel_policy.py (yield: only while they leave a stage free)."""
    if parallel <= 1 or load_policy == "round-robin":
        return True
    return load_policy == "yield" and parallel < n_stages


def stage_seconds(profile: Profile, rank: int, b: int, e: int, draft_on_head: bool = False,
                  head: HeadLoad | None = None) -> float:
    """Seconds of a typical request on profile rank `rank` holding layers [b, e); the head (b == 0)
    also does `head`'s work per generated token (HeadLoad(): the estimate), its draft's only with
    draft_on_head."""
    m = profile.model
    rc = profile.ranks[rank]
    n = e - b
    chunk = min(TYPICAL_PROMPT, max(rc.prefill.rows))
    prefill = n * grid_seconds(rc.prefill, chunk, 0) * (TYPICAL_PROMPT / chunk)
    decode = TYPICAL_GEN * (n * grid_seconds(rc.decode, 1, TYPICAL_KV) + rc.run_overhead_s)
    if e == m.n_layer:
        decode += (TYPICAL_GEN + 1) * rc.output_row_s
    if b == 0:
        head = head or HeadLoad()
        decode += TYPICAL_GEN * head.commits * rc.run_overhead_s
        if draft_on_head and profile.draft is not None:
            decode += TYPICAL_GEN * head.draft_tokens * profile.draft.token_s
    return prefill + decode


def weight_bytes(profile: Profile, b: int, e: int) -> int:
    m = profile.model
    return sum(m.layer_bytes[b:e]) + (m.output_bytes if e == m.n_layer else 0)


def rank_memory(profile: Profile, rank: int, n_ranks: int) -> int:
    """The bytes profile rank `rank` may fill: MEMORY_USE of its host's available memory, divided
    among the ranks of the job (the first n_ranks of the profile) on that host."""
    return int(MEMORY_USE * profile.ranks[rank].mem_available_bytes / sharing(profile, rank, n_ranks))


def sharing(profile: Profile, rank: int, n_ranks: int) -> int:
    """Ranks of the job on profile rank `rank`'s host (as calibrated, else counted by host name)."""
    rc = profile.ranks[rank]
    return max(1, rc.ranks_per_host or sum(1 for r in profile.ranks[:n_ranks] if r.host == rc.host))


def stage_bytes(profile: Profile, mem: JobMemory, b: int, e: int, draft_here: bool) -> int:
    return weight_bytes(profile, b, e) + mem.kv_bytes(e - b) + (mem.draft_bytes if draft_here else 0)


def auto_split(profile: Profile, stage_ranks: list[int], draft_on_head: bool = False,
               mem: JobMemory | None = None, parallel: int = 1, load_policy: str = "yield",
               head: HeadLoad | None = None, head_layers: int | None = None) -> list[tuple[int, int]]:
    """Layer ranges for the stages (profile ranks, in pipeline order) that minimise the slowest
    stage's time on a typical request, within each rank's share of its host's memory.
    parallel, load_policy: requests at once and when they speculate; a draft on the head that
    does not speculate under that load is not counted (see the module doc). head: the head's own
    work per generated token (HeadLoad; None: the estimate). head_layers: the head holds exactly
    that many layers (a lighter head, planner/placement.py), the others are balanced as above."""
    mem = mem or JobMemory()
    draft_on_head = draft_on_head and drafts_under_load(parallel, len(stage_ranks), load_policy)
    n_ranks = len(stage_ranks) + (mem.draft_rank is not None)
    heads_draft = mem.draft_rank is None and mem.draft_bytes > 0
    room = [rank_memory(profile, r, n_ranks) for r in stage_ranks]
    check_memory(profile, stage_ranks, mem, room, heads_draft, n_ranks)

    def cost(i: int, b: int, e: int) -> float:
        if stage_bytes(profile, mem, b, e, heads_draft and i == 0) > room[i]:
            return math.inf
        if i == 0 and head_layers is not None and e != head_layers:
            return math.inf
        return stage_seconds(profile, stage_ranks[i], b, e, draft_on_head and i == 0, head)

    return min_max_split(profile.model.n_layer, len(stage_ranks), cost)


def check_memory(profile: Profile, stage_ranks: list[int], mem: JobMemory, room: list[int], heads_draft: bool,
                 n_ranks: int) -> None:
    """UsageError naming the rank that cannot hold its part when no split fits: each stage in turn
    takes as many layers as fit (which finds a split whenever one exists), the first that cannot
    is named with the bytes it needs and has."""
    if mem.draft_rank is not None and mem.draft_bytes > rank_memory(profile, mem.draft_rank, n_ranks):
        _refuse(profile, mem.draft_rank, mem.draft_bytes, rank_memory(profile, mem.draft_rank, n_ranks),
                "the draft model and its KV cache", mem, n_ranks)
    n_layer, n_stages = profile.model.n_layer, len(stage_ranks)
    b = 0
    for i, r in enumerate(stage_ranks):
        last = n_layer if i == n_stages - 1 else n_layer - (n_stages - 1 - i)
        e = b + 1
        while e < last and stage_bytes(profile, mem, b, e + 1, heads_draft and i == 0) <= room[i]:
            e += 1
        if i == n_stages - 1:
            e = n_layer
        need = stage_bytes(profile, mem, b, e, heads_draft and i == 0)
        if need > room[i]:
            what = f"layers {b}-{e - 1}" + (" and the draft" if heads_draft and i == 0 else "")
            _refuse(profile, r, need, room[i], what, mem, n_ranks)
        b = e


def _refuse(profile: Profile, rank: int, need: int, room: int, what: str, mem: JobMemory, n_ranks: int) -> None:
    rc = profile.ranks[rank]
    kv = f", KV cache at --ctx {mem.n_ctx}" if mem.n_ctx else ""
    raise UsageError(f"--layer-split auto: rank {rank} (host {rc.host}) cannot hold {what}{kv}: it needs "
                     f"{human_bytes(need)}, it has {human_bytes(room)} ({MEMORY_USE:.0%} of the host's "
                     f"{human_bytes(rc.mem_available_bytes)} available, shared by "
                     f"{plural(sharing(profile, rank, n_ranks), 'rank')}); add ranks on other hosts, use a smaller --ctx, or "
                     "run the draft on a rank of its own (auto/1)")
