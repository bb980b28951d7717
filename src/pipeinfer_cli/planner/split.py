"""`--layer-split auto`: the layers balanced by measured time per rank, not by bytes.

Each stage's cost is the measured time of a typical request on it (TYPICAL_PROMPT prompt tokens in
chunks, TYPICAL_GEN one-row decoding runs): its layers at the rank's own seconds per layer for each
phase, the LM head's rows on the last stage, a draft model's tokens on the head when it drafts
there. Both phases count, so neither the prompt (where the LM head reads one row) nor decoding is
balanced at the other's expense. A rank gets no share its memory cannot hold.
"""

from __future__ import annotations

import math

from ..layer_split import min_max_split
from .costs import grid_seconds
from .profile import Profile

TYPICAL_PROMPT = 256
TYPICAL_GEN = 128
TYPICAL_KV = 512
MEMORY_USE = 0.9  # of a rank's available memory, for its weights


def stage_seconds(profile: Profile, rank: int, b: int, e: int, draft_on_head: bool = False) -> float:
    """Seconds of a typical request on profile rank `rank` holding layers [b, e)."""
    m = profile.model
    rc = profile.ranks[rank]
    n = e - b
    chunk = min(TYPICAL_PROMPT, max(rc.prefill.rows))
    prefill = n * grid_seconds(rc.prefill, chunk, 0) * (TYPICAL_PROMPT / chunk)
    decode = TYPICAL_GEN * (n * grid_seconds(rc.decode, 1, TYPICAL_KV) + rc.run_overhead_s)
    if e == m.n_layer:
        decode += (TYPICAL_GEN + 1) * rc.output_row_s
    if b == 0 and draft_on_head and profile.draft is not None:
        decode += TYPICAL_GEN * profile.draft.token_s
    return prefill + decode


def weight_bytes(profile: Profile, b: int, e: int) -> int:
    m = profile.model
    return sum(m.layer_bytes[b:e]) + (m.output_bytes if e == m.n_layer else 0)


def auto_split(profile: Profile, stage_ranks: list[int], draft_on_head: bool = False) -> list[tuple[int, int]]:
    """Layer ranges for the stages (profile ranks, in pipeline order) that minimise the slowest
    stage's time on a typical request, within each rank's memory."""
    def cost(i: int, b: int, e: int) -> float:
        r = stage_ranks[i]
        if weight_bytes(profile, b, e) > MEMORY_USE * profile.ranks[r].mem_available_bytes:
            return math.inf
        return stage_seconds(profile, r, b, e, draft_on_head and i == 0)

    return min_max_split(profile.model.n_layer, len(stage_ranks), cost)
